"""Patch a Hugging Face transformers model to run qkvfuse's fused attention-prepare and add+RMSNorm.

:func:`apply_qkvfuse` rewrites, in place, every attention layer of the text decoder to do one QKV GEMM and one
:func:`qkvfuse.split_qkv_rmsnorm_rope_` call, and every decoder layer to fuse the residual add after attention
with the post-attention RMSNorm (:func:`qkvfuse.add_rmsnorm`). :func:`remove_qkvfuse` undoes it exactly.

Gated attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: ``_Family.q_gate`` / ``gemma_norm``). The full-attention
layers' q_proj emits ``[q_h | gate_h]`` per head, so the concatenated q/k/v weight gives the gated row
``[q_gate | k | v]`` directly; the fused op (``q_gate=True, gemma_norm=True``, the module's own centred norm
weights: the kernel multiplies by ``1 + w`` in fp32 per call) returns the gate as a column view, and the model's
``attn_output * sigmoid(gate)`` and o_proj run as the model has them. The Gated DeltaNet layers (no
``self_attn``) are left alone; their decoder layers' residual add + Gemma post-attention norm are fused like the
others'.

Where the positions come from. transformers computes the positions once per forward and hands them to the text
model's rotary-embedding module; the attention layers only receive the resulting cos/sin. For Qwen3-VL and
GLM-4.5V the decoder layers are passed *text* positions (row 0 of a ``[4, B, T]`` tensor) or None, while the
``[3, B, T]`` temporal/height/width positions reach only the rotary module. So the patch wraps that module's
``forward`` to capture the ids it is given, and the patched attention reads them from there: the height/width
rows of image tokens cannot be dropped, and decode steps get whatever transformers computed
(``cache_len + rope_delta`` for Qwen3-VL). A forward hook on the text model clears the captured ids after each
forward, so a stale capture can never be used. The same code path serves prefill, decode with a KV cache and
padded batches: nothing branches on the forward mode.

The rotary table is built once per model and device by :func:`qkvfuse.build_cos_sin_cache` from the config's
``rope_parameters`` (theta, scaling, partial rotary factor) with ``max_position_embeddings`` rows, in fp32 (grown
in eager forwards when the captured positions reach past it, as transformers' rotary computes any position),
and checked at patch time against the inverse frequencies and attention scaling of the model's own rotary
module; the mRoPE sections are the rotary module's own (transformers' default when the config omits them).
Qwen3-VL is always interleaved: transformers never reads ``mrope_interleaved``.

Each layer holds bound ops (:class:`qkvfuse.QKNormRope`, :class:`qkvfuse.AddRMSNorm`) built once per table,
norm weights and eps, so a decode step pays only the per-call checks. The scalars transformers reads per call are
read per call here too: the norms' eps (a bound op is rebuilt when one changed by value; q_norm and k_norm with
different eps run unfused, the op takes one), GLM's ``use_qk_norm``, and, once per forward, the rotary module's
``attention_scaling`` and ``mrope_section`` (by value: the list may be edited in place), which re-derive the table,
or run the attention unfused when the table can no longer reproduce them.

Tested code only. The transformers functions whose behaviour the fused forwards replace or reproduce -- each
attention and decoder layer forward, the modeling module's ``apply_rotary_pos_emb`` and ``rotate_half``, the
rotary module's forward (and mRoPE ``recomposition_frequencies``), the norms' forward, the GLM MoE block forward
that ``shared_expert_overlap`` replaces -- must hash to a version in :data:`TESTED_SOURCES` (transformers
:data:`TESTED_TRANSFORMERS`; the engine plugins' guard and hash). A layer class whose code does not keeps
transformers' own forward, with one warning per class at patch time; :func:`source_hashes` gives what a model's
code hashes to, for bumping transformers.

Weights. q/k/v projection weights (and biases) are concatenated once, at patch time, and each projection's
parameter becomes a view into the concatenated tensor, so the attention weights are not duplicated. If the
views are broken later (``model.to(...)``, a parameter replaced), the next forward re-concatenates; under
torch.compile the check runs once per trace and dynamo's guards on the parameter objects trigger the retrace.

Edits after patching. Each patched layer remembers the modules its fused path stands in for (q/k/v projections,
q/k norms, the post-attention norm) and checks per call, by identity and dict emptiness only, that they are
still there and carry no forward hooks, pre-hooks or instance forward (and that no global module hook is
registered). A plain ``nn.Linear`` (or same-class norm) put in their place is adopted; anything else (a LoRA
wrapper, a hook) makes that call run transformers' unfused code for the layer, with one warning naming why.

Copies. Forwards are ``functools.partial(<module-level function>, module)`` and the clearing hook is a
module-level function, with the per-model state in plain attributes: ``copy.deepcopy``, ``pickle`` and
``torch.save`` give a patched copy that owns its fused weights. Patching is idempotent across nesting.

Offloaded models (accelerate ``device_map`` with CPU/disk offload: parameters on the meta device, hooks that
materialise them per forward) are refused at patch time with ``NotImplementedError``, before anything changes.

Dtypes. The ops take fp32, bf16 and fp16 activations (with fp32 norm weights or weights of the activations'
dtype: :func:`qkvfuse._checks.served_dtypes`). Any other call -- a model cast with ``.double()`` after patching,
to compute a reference -- runs each layer's own code, with one warning per model and dtype.

Autocast. Under ``torch.autocast`` an fp32 model's projections give bf16/fp16 activations while the residual
stream stays fp32: transformers adds the attention output to the residual with type promotion (fp32) and its
RMSNorm runs in fp32. The fused add+norm requires equal dtypes, so with autocast enabled (or whenever the two
dtypes differ) each decoder layer runs its own unfused code for that call, with one warning; the fused attention
prepare still runs (low-precision qkv with fp32 norm weights, the rotary table in fp32).

The patched model is for inference: the fused ops have no autograd formula. A call that must record autograd
(grad mode on and an input or parameter that requires grad, e.g. a plain ``model(ids)`` outside
``torch.no_grad()``) runs transformers' unfused code for that layer, with one warning, so gradients are those of
the unpatched model. The captured positions live on
the text model, so one patched model must not run two forwards concurrently from different threads (its
transformers state, e.g. Qwen3-VL's ``rope_deltas``, has the same limit).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
import sys
import textwrap
import types
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import ops
from .._checks import FLOATS, served_dtypes
from ..backends import resolve_backend
from ..rope import build_cos_sin_cache, compute_inv_freq
from ._engine_common import first_untested
from ._rebind import Rebinding

__all__ = ["apply_qkvfuse", "remove_qkvfuse", "SUPPORTED_MODELS", "is_patched", "TESTED_SOURCES",
           "TESTED_TRANSFORMERS", "source_hash", "source_hashes"]


@dataclasses.dataclass(frozen=True)
class _Family:
    """How one model family is laid out: the transformers classes the patch expects (matched by name through the
    MRO, so subclasses are accepted), and its rotary layout."""

    classes: Tuple[str, ...]  # the family's model classes (for messages)
    text_model: str  # the decoder stack: has ``rotary_emb`` and ``layers``
    decoder_layer: str
    attention: str
    mrope_interleaved: Optional[bool] = None  # None: plain RoPE; True: Qwen3-VL; False: contiguous sections
    # Gated attention (Qwen3-Next, Qwen3.5): q_proj emits [q_h | gate_h] per head and the attention output is
    # multiplied by sigmoid(gate) before o_proj (the model's own code, left as is).
    q_gate: bool = False
    gemma_norm: bool = False  # QK and decoder RMSNorm weights centred at 0 (x * (1 + w) in fp32)
    # The linear-attention class of the layers that have no ``self_attn`` (Gated DeltaNet): left alone, their
    # decoder layers' residual add + post-attention norm still fused.
    linear_attention: Optional[str] = None


_QWEN3 = _Family(("Qwen3ForCausalLM", "Qwen3Model"), "Qwen3Model", "Qwen3DecoderLayer", "Qwen3Attention")
_QWEN3_MOE = _Family(("Qwen3MoeForCausalLM", "Qwen3MoeModel"), "Qwen3MoeModel", "Qwen3MoeDecoderLayer",
                     "Qwen3MoeAttention")
_QWEN3_VL = _Family(("Qwen3VLForConditionalGeneration", "Qwen3VLModel", "Qwen3VLTextModel"), "Qwen3VLTextModel",
                    "Qwen3VLTextDecoderLayer", "Qwen3VLTextAttention", mrope_interleaved=True)
_GLM4_MOE = _Family(("Glm4MoeForCausalLM", "Glm4MoeModel"), "Glm4MoeModel", "Glm4MoeDecoderLayer",
                    "Glm4MoeAttention")
_GLM4V_MOE = _Family(("Glm4vMoeForConditionalGeneration", "Glm4vMoeModel", "Glm4vMoeTextModel"),
                     "Glm4vMoeTextModel", "Glm4vMoeTextDecoderLayer", "Glm4vMoeTextAttention",
                     mrope_interleaved=False)
# Qwen3-VL-MoE: transformers' own copies of the Qwen3-VL text classes (not subclasses), the same layout.
_QWEN3_VL_MOE = _Family(("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel", "Qwen3VLMoeTextModel"),
                        "Qwen3VLMoeTextModel", "Qwen3VLMoeTextDecoderLayer", "Qwen3VLMoeTextAttention",
                        mrope_interleaved=True)
_QWEN3_NEXT = _Family(("Qwen3NextForCausalLM", "Qwen3NextModel"), "Qwen3NextModel", "Qwen3NextDecoderLayer",
                      "Qwen3NextAttention", q_gate=True, gemma_norm=True, linear_attention="Qwen3NextGatedDeltaNet")
# Qwen3.5: interleaved mRoPE for text-only prompts too (the rotary module always takes [3, B, T] positions).
_QWEN3_5 = _Family(("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5Model", "Qwen3_5TextModel"),
                   "Qwen3_5TextModel", "Qwen3_5DecoderLayer", "Qwen3_5Attention", mrope_interleaved=True,
                   q_gate=True, gemma_norm=True, linear_attention="Qwen3_5GatedDeltaNet")
_QWEN3_5_MOE = _Family(("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeModel",
                        "Qwen3_5MoeTextModel"), "Qwen3_5MoeTextModel", "Qwen3_5MoeDecoderLayer",
                       "Qwen3_5MoeAttention", mrope_interleaved=True, q_gate=True, gemma_norm=True,
                       linear_attention="Qwen3_5MoeGatedDeltaNet")

# The one list of supported models: ``config.model_type`` -> family (Liger's dispatch: subclasses of the
# transformers classes, and the bare text models of the multimodal families, are recognised by their config).
SUPPORTED_MODELS: Dict[str, _Family] = {
    "qwen3": _QWEN3,
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_vl": _QWEN3_VL, "qwen3_vl_text": _QWEN3_VL,
    "glm4_moe": _GLM4_MOE,
    "glm4v_moe": _GLM4V_MOE, "glm4v_moe_text": _GLM4V_MOE,
    "qwen3_vl_moe": _QWEN3_VL_MOE, "qwen3_vl_moe_text": _QWEN3_VL_MOE,
    "qwen3_next": _QWEN3_NEXT,
    "qwen3_5": _QWEN3_5, "qwen3_5_text": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5_MOE, "qwen3_5_moe_text": _QWEN3_5_MOE,
}
# Wrappers whose text stack is whatever their ``text_config`` names (GLM-4.6V: ``AutoModel.from_config``, a dense
# ``glm4v_text`` or an MoE ``glm4v_moe_text`` model): supported when the text config's model type is.
BY_TEXT_CONFIG: Tuple[str, ...] = ("glm46v",)
_OVERLAP_ENV = "QKVFUSE_SHARED_EXPERT_OVERLAP"
_FUSABLE_DTYPES = FLOATS  # what the ops take (qkvfuse._checks): the projections' dtypes at patch time


# --------------------------------------------------------------------------------------------------------
# The transformers code the fused forwards replace or reproduce, by a hash of its source. A layer class whose
# code hashes to none of the tested versions keeps transformers' own forward, with one warning per patch.
# --------------------------------------------------------------------------------------------------------
# the dev venv's; the engine venvs' (make test-vllm runs the guard tests there)
TESTED_TRANSFORMERS: Tuple[str, ...] = ("5.19.0", "5.23.0")
TESTED_SOURCES: Dict[str, Tuple[str, ...]] = {
    "Qwen3Attention.forward": ("95140604894f7733",),
    "Qwen3DecoderLayer.forward": ("461ed20abeb521a9",),
    "Qwen3RMSNorm.forward": ("d676bfe9af0e524d",),
    "Qwen3RotaryEmbedding.forward": ("2b71104c384d7ed6",),
    "modeling_qwen3.apply_rotary_pos_emb": ("ea234325c15de475",),
    "modeling_qwen3.rotate_half": ("f714a4b1160c694e",),
    "Qwen3MoeAttention.forward": ("95140604894f7733",),
    "Qwen3MoeDecoderLayer.forward": ("461ed20abeb521a9",),
    "Qwen3MoeRMSNorm.forward": ("d676bfe9af0e524d",),
    "Qwen3MoeRotaryEmbedding.forward": ("2b71104c384d7ed6",),
    "modeling_qwen3_moe.apply_rotary_pos_emb": ("ea234325c15de475",),
    "modeling_qwen3_moe.rotate_half": ("f714a4b1160c694e",),
    "Qwen3VLTextAttention.forward": ("5d6148ad4fd8d7ff",),
    "Qwen3VLTextDecoderLayer.forward": ("f09c54bd28268d8d",),
    "Qwen3VLTextRMSNorm.forward": ("d676bfe9af0e524d",),
    "Qwen3VLTextRotaryEmbedding.forward": ("ea0b63112c8123db",),
    "Qwen3VLTextRotaryEmbedding.recomposition_frequencies": ("3ddfd42b631af4e3",),
    "modeling_qwen3_vl.apply_rotary_pos_emb": ("ea234325c15de475",),
    "modeling_qwen3_vl.rotate_half": ("f714a4b1160c694e",),
    "Glm4MoeAttention.forward": ("f411c850bb07728e",),
    "Glm4MoeDecoderLayer.forward": ("461ed20abeb521a9",),
    "Glm4MoeRMSNorm.forward": ("d676bfe9af0e524d",),
    "Glm4MoeRotaryEmbedding.forward": ("2b71104c384d7ed6",),
    "modeling_glm4_moe.apply_rotary_pos_emb": ("8e62703ac8727b8f",),
    "modeling_glm4_moe.rotate_half": ("f714a4b1160c694e",),
    "Glm4vMoeTextAttention.forward": ("4c606200fe2a59bd",),
    "Glm4vMoeTextDecoderLayer.forward": ("461ed20abeb521a9",),
    "Glm4vMoeTextRMSNorm.forward": ("d676bfe9af0e524d",),
    "Glm4vMoeTextRotaryEmbedding.forward": ("294a2ba912b71388",),
    "Glm4vMoeTextRotaryEmbedding.recomposition_frequencies": ("5d46ebfc50edbe3f",),
    "modeling_glm4v_moe.apply_rotary_pos_emb": ("8e62703ac8727b8f",),
    "modeling_glm4v_moe.rotate_half": ("f714a4b1160c694e",),
    "Qwen3VLMoeTextAttention.forward": ("5d6148ad4fd8d7ff",),
    "Qwen3VLMoeTextDecoderLayer.forward": ("461ed20abeb521a9",),
    "Qwen3VLMoeTextRMSNorm.forward": ("d676bfe9af0e524d",),
    "Qwen3VLMoeTextRotaryEmbedding.forward": ("76fb98391d18c78c",),
    "Qwen3VLMoeTextRotaryEmbedding.recomposition_frequencies": ("3ddfd42b631af4e3",),
    "modeling_qwen3_vl_moe.apply_rotary_pos_emb": ("ea234325c15de475",),
    "modeling_qwen3_vl_moe.rotate_half": ("f714a4b1160c694e",),
    "Qwen3NextAttention.forward": ("330be94d2d451973",),
    "Qwen3NextDecoderLayer.forward": ("7c1274273e8590ec", "0844175983c2eb56",),
    "Qwen3NextRMSNorm.forward": ("509615cb1d1cc91a",),
    "Qwen3NextRotaryEmbedding.forward": ("2b71104c384d7ed6",),
    "modeling_qwen3_next.apply_rotary_pos_emb": ("ab8feb64f1955571",),
    "modeling_qwen3_next.rotate_half": ("f714a4b1160c694e",),
    "Qwen3_5Attention.forward": ("330be94d2d451973",),
    "Qwen3_5DecoderLayer.forward": ("712847e15548802e", "6f4911be93fce949",),
    "Qwen3_5RMSNorm.forward": ("ab138eff95730604",),
    "Qwen3_5TextRotaryEmbedding.forward": ("c12d419b2e9ce914",),
    "Qwen3_5TextRotaryEmbedding.recomposition_frequencies": ("3ddfd42b631af4e3",),
    "modeling_qwen3_5.apply_rotary_pos_emb": ("ab8feb64f1955571",),
    "modeling_qwen3_5.rotate_half": ("f714a4b1160c694e",),
    "Qwen3_5MoeAttention.forward": ("330be94d2d451973",),
    "Qwen3_5MoeDecoderLayer.forward": ("7c1274273e8590ec", "0844175983c2eb56",),
    "Qwen3_5MoeRMSNorm.forward": ("7a580d8d09970afd",),
    "Qwen3_5MoeTextRotaryEmbedding.forward": ("96d4afea05dcf8f1",),
    "Qwen3_5MoeTextRotaryEmbedding.recomposition_frequencies": ("3ddfd42b631af4e3",),
    "modeling_qwen3_5_moe.apply_rotary_pos_emb": ("ab8feb64f1955571",),
    "modeling_qwen3_5_moe.rotate_half": ("f714a4b1160c694e",),
    # the GLM MoE block forward that shared_expert_overlap replaces (qkvfuse.moe.glm4)
    "Glm4MoeMoE.forward": ("9586dc1a570ee53c",),
    "Glm4vMoeTextMoE.forward": ("9586dc1a570ee53c",),
}


def source_hash(fn: Callable) -> str:
    """The hash :data:`TESTED_SOURCES` holds for a function: sha256 of its dedented source (decorators included),
    16 hex digits, as the engine plugins hash engine code."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


_hashes: Dict[Callable, str] = {}  # a model has many layers of one class: each function is read once


def _known_hash(fn: Callable) -> str:
    digest = _hashes.get(fn)
    if digest is None:
        try:
            digest = source_hash(fn)
        except (OSError, TypeError):  # no source to read (a compiled or generated function): not the tested code
            digest = ""
        _hashes[fn] = digest
    return digest


def _method(cls: type, name: str) -> Tuple[str, Optional[Callable]]:
    """``("<class>.<name>", function)``, named after the first class of ``cls``'s MRO that defines this code: a
    subclass that only re-wraps it (transformers wraps every decoder layer subclass's forward for gradient
    checkpointing) names the base class, one that overrides it names itself."""
    fn = getattr(cls, name, None)
    code = inspect.unwrap(fn) if fn is not None else None
    owners = [c for c in cls.__mro__ if name in c.__dict__ and inspect.unwrap(getattr(c, name)) is code]
    return f"{(owners[-1] if owners else cls).__name__}.{name}", fn


def _attention_sources(attn: nn.Module, rotary: nn.Module, family: _Family) -> Dict[str, Optional[Callable]]:
    """What the fused attention stands in for: the attention forward it replaces, and the code whose results it
    reproduces -- the model module's rotation functions, the rotary module's cos/sin (and mRoPE layout) and the
    q/k norms' forward."""
    base = _base(type(attn), family.attention)
    module = sys.modules[base.__module__]
    short = base.__module__.rsplit(".", 1)[-1]
    found = dict([_method(type(attn), "forward"), _method(type(rotary), "forward")])
    for name in ("apply_rotary_pos_emb", "rotate_half"):
        found[f"{short}.{name}"] = getattr(module, name, None)
    if family.mrope_interleaved is not None:
        found.update([_method(type(rotary), "recomposition_frequencies")])
    if _uses_qk_norm(attn):
        found.update([_method(type(attn.q_norm), "forward"), _method(type(attn.k_norm), "forward")])
    return found


def _layer_sources(layer: nn.Module) -> Dict[str, Optional[Callable]]:
    """What the fused decoder layer stands in for: its forward, and the post-attention norm's forward. (The GLM MoE
    block's forward, which ``shared_expert_overlap`` replaces, is checked per block in :func:`_patch_moe`.)"""
    return dict([_method(type(layer), "forward"), _method(type(layer.post_attention_layernorm), "forward")])


def _untested(sources: Dict[str, Optional[Callable]]) -> Optional[str]:
    """Why this code is not the tested transformers code (a source missing or hashing differently), or None."""
    names = list(sources)
    return first_untested(names, sources, {n: TESTED_SOURCES.get(n, ()) for n in names}, _known_hash,
                          "transformers", ", ".join(TESTED_TRANSFORMERS))


def source_hashes(model: nn.Module) -> Dict[str, str]:
    """``{name: hash}`` of every transformers function :func:`apply_qkvfuse` checks against
    :data:`TESTED_SOURCES` for ``model`` (a supported model, patched or not).

    When bumping transformers: run it on a model of each supported family under the new version, check the
    fused models against the unpatched ones (the tests), then add the new hashes to :data:`TESTED_SOURCES` and
    the version to :data:`TESTED_TRANSFORMERS`.
    """
    family = _family_of(model)
    found: Dict[str, Optional[Callable]] = {}
    for text_model in _text_models(model, family):
        for layer in text_model.layers:
            attn = _attention_of(layer)
            if attn is not None:
                found.update(_attention_sources(attn, text_model.rotary_emb, family))
            found.update(_layer_sources(layer))
    try:
        is_block = _glm4_moe_api().is_block
    except NotImplementedError:  # no qkvfuse.moe here: apply_qkvfuse patches no MoE block either
        is_block = None
    if is_block is not None:
        found.update(_method(type(m), "forward") for m in model.modules() if is_block(m))
    return {name: _known_hash(fn) if fn is not None else "" for name, fn in sorted(found.items())}


# --------------------------------------------------------------------------------------------------------
# Positions and the rotary table (one per text model).
# --------------------------------------------------------------------------------------------------------
class _Rope:
    """Positions captured from the text model's rotary module, and the cos/sin table the fused op reads."""

    def __init__(self, rotary: nn.Module, mrope_interleaved: Optional[bool]):
        self.rotary = rotary  # the module whose forward captures the positions (the text model's rotary_emb)
        self.family_interleaved = mrope_interleaved
        self.unfused: Optional[str] = None  # why the attention layers run unfused (a replaced rotary_emb), or None
        config = rotary.config
        params = dict(config.rope_parameters)
        self.theta = float(params["rope_theta"])
        self.rope_parameters = params
        self.max_position = int(config.max_position_embeddings)
        # The width the model itself rotates (Qwen3 ignores partial_rotary_factor, GLM applies it).
        self.rotary_dim = 2 * rotary.original_inv_freq.numel()
        self.mrope_section: Optional[Tuple[int, int, int]] = None
        self.mrope_interleaved = bool(mrope_interleaved)
        if mrope_interleaved is not None:
            self.mrope_section = tuple(int(s) for s in rotary.mrope_section)
            if sum(self.mrope_section) != self.rotary_dim // 2:
                raise NotImplementedError(
                    f"apply_qkvfuse: the rotary module's mrope_section {list(self.mrope_section)} does not cover "
                    f"the {self.rotary_dim // 2} frequencies of its rotary dim {self.rotary_dim}")
        self.settings = _rotary_settings(rotary)  # what its forward reads per call besides inv_freq
        self._check_against(rotary)
        self.rows = self.max_position  # rows of the table; grows with the positions the model computes
        self.captured: Optional[torch.Tensor] = None
        self._tables: Dict[torch.device, torch.Tensor] = {}
        self.state: Optional["_PatchState"] = None  # the patch that owns this text model

    def __getstate__(self):
        # deepcopy / pickle: no capture outlives a forward, and the tables are rebuilt (prebuild, on first use).
        return {**self.__dict__, "captured": None, "_tables": {}}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.prebuild()  # the copied rotary module is complete by now (deepcopy copies the state first)

    def _check_against(self, rotary: nn.Module) -> None:
        try:
            inv_freq, scale = compute_inv_freq(self.rotary_dim, self.theta, self.rope_parameters, self.max_position)
        except ValueError as exc:
            raise NotImplementedError(f"apply_qkvfuse: the model's rope_parameters are not supported: {exc}") from None
        model_inv_freq = rotary.original_inv_freq.detach().to("cpu")
        model_scale = float(getattr(rotary, "attention_scaling", 1.0))
        # model.to(bf16) after construction also rounds the rotary module's inv_freq buffers; judge our fp32
        # frequencies at the precision the model holds them.
        rtol = max(1e-6, torch.finfo(model_inv_freq.dtype).eps)
        if (not torch.allclose(inv_freq.to(model_inv_freq.dtype).float(), model_inv_freq.float(), rtol=rtol, atol=0)
                or abs(scale - model_scale) > 1e-6 * abs(model_scale)):
            raise NotImplementedError(
                f"apply_qkvfuse: the rotary table built from rope_parameters={self.rope_parameters} does not match "
                f"the model's rotary embedding ({type(rotary).__name__}); refusing to patch")
        if model_inv_freq.dtype != torch.float32:
            warnings.warn(
                f"apply_qkvfuse: {type(rotary).__name__}.inv_freq is stored in {model_inv_freq.dtype} (was the model "
                f"cast with .to(dtype) after loading? load with dtype= instead); qkvfuse rotates with the fp32 "
                f"frequencies, so the patched model differs from the unpatched one at large positions",
                RuntimeWarning, stacklevel=4)

    def adopt(self, rotary: Optional[nn.Module]) -> None:
        """Follow a text model whose ``rotary_emb`` was replaced, or whose settings read per call
        (``attention_scaling``, ``mrope_section``) changed by value: derive the table from the module (its config's
        rope parameters, checked against its frequencies and scaling as at patch time) and capture its positions; a
        module qkvfuse cannot reproduce makes the attention layers run transformers' unfused code (one warning)."""
        old, state = self.rotary, self.state
        self.settings = None if rotary is None else _rotary_settings(rotary)  # judged once per change
        if old is not None and _own_forward(old):
            del old.forward
            del old._qkvfuse_rope
        if state is not None and old in state.rotaries:
            state.rotaries.remove(old)
        self.rotary = rotary
        try:
            if rotary is None or "forward" in rotary.__dict__ or not hasattr(rotary, "original_inv_freq"):
                raise NotImplementedError("it is not a rotary module of the model's family with its own forward")
            fresh = _Rope(rotary, self.family_interleaved)
        except NotImplementedError as exc:
            what = (f"changed in place ({type(rotary).__name__}) to settings" if rotary is old
                    else f"was replaced by a {type(rotary).__name__}")
            self.unfused = f"because the text model's rotary_emb {what} that qkvfuse cannot reproduce ({exc})"
            return
        for name in ("theta", "rope_parameters", "max_position", "rotary_dim", "mrope_section", "mrope_interleaved",
                     "rows"):
            setattr(self, name, getattr(fresh, name))
        self._tables = {}
        self.unfused = None
        self.prebuild()
        rotary._qkvfuse_rope = self
        rotary.forward = functools.partial(_capturing_rotary_forward, rotary)
        if state is not None:
            state.rotaries.append(rotary)

    def prebuild(self) -> None:
        """Build the table on the rotary module's device now (none for a meta model): a model compiled right after
        ``apply_qkvfuse`` finds it, where a build inside the traced forward cannot be traced."""
        inv_freq = getattr(self.rotary, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and not inv_freq.is_meta:
            self.table(inv_freq.device)

    def table(self, device: torch.device) -> torch.Tensor:
        """``[rows, rotary_dim]`` fp32 cos/sin table on ``device`` (built on first use, or by :meth:`prebuild`)."""
        table = self._tables.get(device)
        if table is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"qkvfuse: no cos/sin table on {device} yet, and it cannot be built inside torch.compile; run the "
                    f"model once eagerly on {device}, or call apply_qkvfuse(model) again after moving it, before "
                    f"compiling")
            table = build_cos_sin_cache(self.rotary_dim, self.rows, self.theta, self.rope_parameters,
                                        dtype=torch.float32, device=device)
            self._tables[device] = table
        return table

    def cover(self, position_ids: torch.Tensor) -> None:
        """Grow the table (at least doubling) so that it holds every position in ``position_ids``.

        transformers' rotary modules of the supported rope types compute any position from fixed frequencies, so
        a prompt longer than ``max_position_embeddings`` runs unpatched; the grown table has the same frequencies
        (rows are ``p * inv_freq``, so its first rows are the old table's). One host read of the largest position
        per forward (all layers share the table); none under torch.compile or CUDA graph capture.
        """
        if position_ids.is_meta or not position_ids.numel() or (
                position_ids.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        top = int(position_ids.max())
        if top < self.rows:
            return
        rows = max(top + 1, 2 * self.rows)
        fixed = compute_inv_freq(self.rotary_dim, self.theta, self.rope_parameters, self.max_position)
        grown = compute_inv_freq(self.rotary_dim, self.theta, self.rope_parameters, rows)
        if not (torch.equal(fixed[0], grown[0]) and fixed[1] == grown[1]):
            raise NotImplementedError(
                f"qkvfuse: position {top} is past max_position_embeddings={self.max_position}, and the rope "
                f"frequencies of rope_parameters={self.rope_parameters} depend on the table length (give 'factor' "
                f"and 'original_max_position_embeddings' explicitly)")
        self.rows = rows
        self._tables.clear()


def _flat_positions(captured: Optional[torch.Tensor], batch: int, seq: int, mrope: bool) -> torch.Tensor:
    """The captured rotary ids as the fused op's ``positions``: ``[B*T]`` (RoPE) or ``[3, B*T]`` (mRoPE).

    transformers may hand the rotary module ``[1, T]`` for a batch of B (Qwen3 without explicit ids) or
    ``[B, T]`` text ids to a multimodal model; both are broadcast as the rotary module itself does.
    """
    if captured is None:
        raise RuntimeError(
            "qkvfuse: no positions were captured from the rotary embedding in this forward; a patched attention "
            "layer must be run through its text model's forward (which computes the positions)")
    if captured.shape[-1] != seq:
        raise RuntimeError(f"qkvfuse: captured positions of shape {tuple(captured.shape)} do not match the "
                           f"hidden states (batch {batch}, {seq} tokens)")
    if mrope:
        return captured.expand(3, batch, seq).reshape(3, batch * seq)
    return captured.expand(batch, seq).reshape(batch * seq)


def _rotary_settings(rotary: nn.Module) -> Tuple:
    """The scalars a transformers rotary forward reads per call and the table bakes in: the cos/sin scaling and the
    mRoPE sections (plain attributes; a list may be edited in place, so compared by value)."""
    section = rotary.__dict__.get("mrope_section")
    return rotary.__dict__.get("attention_scaling", 1.0), None if section is None else tuple(section)


def _capturing_rotary_forward(self, x, position_ids, *args, **kwargs):
    """The rotary module's forward, recording the ids it is given (installed as ``functools.partial(fn, module)``:
    module-level functions keep a patched model picklable and deep-copyable)."""
    rope: _Rope = self._qkvfuse_rope
    rope.captured = position_ids
    if not torch.compiler.is_compiling():
        rope.cover(position_ids)
    return type(self).forward(self, x, position_ids, *args, **kwargs)


def _clear_positions(module, args, output) -> None:
    """Forward hook of the text model (always called): the capture lives for one forward only."""
    module._qkvfuse_rope.captured = None


@torch.compiler.disable
def _adopt_rotary(rope: _Rope, rotary) -> None:
    rope.adopt(rotary)  # builds and checks a table on the host: never traced


def _follow_rotary(module, args) -> None:
    """Forward pre-hook of the text model: a ``rotary_emb`` replaced, or its per-call settings changed, since the
    last forward is adopted before it runs (an identity check and two attribute reads per forward)."""
    rope = module._qkvfuse_rope
    rotary = module._modules.get("rotary_emb")
    if rotary is not rope.rotary or (rotary is not None and _rotary_settings(rotary) != rope.settings):
        _adopt_rotary(rope, rotary)


# --------------------------------------------------------------------------------------------------------
# The patched attention.
# --------------------------------------------------------------------------------------------------------
def _norm_eps(norm: nn.Module) -> Optional[float]:
    """An RMSNorm's epsilon: ``variance_epsilon`` (Qwen3, GLM) or ``eps`` (the Gemma-style norms of Qwen3-Next and
    Qwen3.5); None for a module with neither."""
    eps = getattr(norm, "variance_epsilon", None)
    return getattr(norm, "eps", None) if eps is None else eps


def _attention_of(layer: nn.Module) -> Optional[nn.Module]:
    """The decoder layer's ``self_attn`` (None for a linear-attention layer of Qwen3-Next / Qwen3.5)."""
    return layer._modules.get("self_attn")


def _uses_qk_norm(attn: nn.Module) -> bool:
    """Whether the attention normalises q and k per head: it has ``q_norm`` and, for GLM, ``use_qk_norm`` is on
    (a plain attribute that GLM's forward reads per call)."""
    return attn._modules.get("q_norm") is not None and bool(attn.__dict__.get("use_qk_norm", True))


def _serves(dtype: torch.dtype, weights) -> bool:
    """Whether the fused ops take activations of ``dtype`` with these norm weights (None: absent): a dtype the ops
    take (:data:`qkvfuse._checks.FLOATS`) that the weights serve (:func:`qkvfuse._checks.served_dtypes`)."""
    return dtype in FLOATS and dtype in served_dtypes(weights)


def _is_plain_linear(module) -> bool:
    # Quantised layers often subclass nn.Linear and keep packed weights: only the exact class is safe to fuse.
    return type(module) is nn.Linear


# Module-wide hooks (torch.nn.modules.module.register_module_forward_hook / _pre_hook) fire for every module the
# unfused code calls; the fused path does not call the projections or norms. The dicts are never rebound.
_GLOBAL_HOOKS = (_nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks)


def _module_edit(name: str, module: nn.Module) -> Optional[str]:
    """Why the fused path would skip something the user attached to ``module`` (a hook or an instance forward)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return f"because {name} has forward hooks or pre-hooks, which the fused path would not call"
    if "forward" in module.__dict__:
        return f"because {name}.forward was replaced on the instance, which the fused path would not call"
    return None


def _global_hook_edit() -> Optional[str]:
    if _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]:
        return ("because a global module forward hook is registered (torch.nn.modules.module."
                "register_module_forward_hook), which the fused path would not call for the fused modules")
    return None


def _trace_time_sync(fused: "_FusedAttention", attn: nn.Module) -> bool:
    """Under torch.compile, once per trace on the real tensors: adopt replaced projections and re-derive the fused
    weight if the projections' parameters are no longer views into it (data pointers do not trace)."""
    fused.edit(attn, adopt=True)
    fused.qkv_params()
    return True


_trace_time_sync = torch._dynamo.assume_constant_result(_trace_time_sync)


class _FusedAttention:
    """Per-attention-layer state: geometry, the concatenated QKV parameters, and the modules the fused path
    stands in for (q/k/v projections, q/k norms), so that a replaced or hooked one is noticed per call."""

    def __init__(self, attn: nn.Module, rope: _Rope, backend: Optional[str], eager, family: _Family,
                 model_name: str = ""):
        config = attn.config
        self.rope = rope
        self.model_name = model_name  # the text model's class, named by the one warning for an unserved dtype
        self.backend = backend
        self.num_q_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.q_gate, self.gemma_norm = family.q_gate, family.gemma_norm
        # Gated: q_proj's rows are [q_0 | g_0 | q_1 | g_1 | ...], so the fused row is the op's [q_gate | k | v].
        q_width = (2 if self.q_gate else 1) * self.num_q_heads * self.head_dim
        self.widths = (q_width, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        self.in_features = attn.q_proj.in_features
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        reason = self._unfusable(projections)
        if reason is not None:
            raise ValueError(f"apply_qkvfuse: {reason}")
        self.projections = projections
        # QK-norm: Qwen3 always, GLM-4.x when use_qk_norm (off for 4.5-Air), GLM-4.5V never. GLM's forward reads
        # use_qk_norm per call, so edit() follows it; the eps is the q_norm's at each call (bound()).
        self.qk_norm = _uses_qk_norm(attn)
        self.norms = (attn.q_norm, attn.k_norm) if self.qk_norm else ()
        self.eps = float(_norm_eps(attn.q_norm)) if self.qk_norm else 1e-6
        self.sliding_window = "sliding_window" in vars(attn)  # Qwen3 passes it to the attention interface
        self.eager = eager
        self.weight: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None
        self.params: Tuple = ()  # the parameter objects the fused weight was derived from
        self._bound: Optional[Rebinding] = None  # the layer's QKNormRope, rebuilt when its tensors change
        self.fuse()

    def __getstate__(self):
        # deepcopy / pickle: the bound op (it holds dispatcher handles) is rebuilt on first use.
        return {**self.__dict__, "_bound": None}

    def _unfusable(self, projections) -> Optional[str]:
        for name, proj, width in zip(("q_proj", "k_proj", "v_proj"), projections, self.widths):
            if not _is_plain_linear(proj):
                return (f"{name} is a {type(proj).__module__}.{type(proj).__name__}, not a plain torch.nn.Linear "
                        f"(e.g. a LoRA or quantisation wrapper), which the fused QKV GEMM cannot stand in for")
            if proj.out_features != width or proj.in_features != self.in_features:
                return (f"{name} maps {proj.in_features} -> {proj.out_features} features, expected "
                        f"{self.in_features} -> {width} from the config's heads x head_dim")
            if proj.weight.dtype not in _FUSABLE_DTYPES:
                return f"{name}.weight has dtype {proj.weight.dtype}; expected one of {list(_FUSABLE_DTYPES)}"
        return None

    def edit(self, attn: nn.Module, adopt: Optional[bool] = None) -> Optional[str]:
        """Why this call cannot take the fused path, or None (identity and dict-emptiness checks only).

        A projection replaced by another plain ``nn.Linear`` of the same shape is adopted (the fused weight is
        re-derived); a norm replaced by one of the same class is adopted. Anything else the fused path cannot
        honour (a wrapper such as LoRA, a hook, an instance forward, a global module hook) is returned as the
        reason to run transformers' unfused code for this call. ``adopt``: whether a replaced projection may be
        adopted here (default: outside torch.compile, where it re-derives the weight; under compile only the
        trace-time sync adopts, and a call that still sees a replaced module runs unfused).
        """
        if self.rope.unfused is not None:
            return self.rope.unfused
        m = attn._modules
        q, k, v = self.projections
        if m.get("q_proj") is not q or m.get("k_proj") is not k or m.get("v_proj") is not v:
            new = (m.get("q_proj"), m.get("k_proj"), m.get("v_proj"))
            reason = self._unfusable(new)
            if reason is not None:
                return f"because {reason}"
            if adopt is None:
                adopt = not torch.compiler.is_compiling()
            if not adopt:
                return "because a projection was replaced after patching (retrace pending)"
            self.projections = new
            self.fuse()
            q, k, v = self.projections
        if _uses_qk_norm(attn) != self.qk_norm:  # GLM's use_qk_norm switched since the last call
            self.qk_norm = not self.qk_norm
            self.norms = (m["q_norm"], m["k_norm"]) if self.qk_norm else ()
        if self.qk_norm:
            qn, kn = self.norms
            if m.get("q_norm") is not qn or m.get("k_norm") is not kn:
                new = (m.get("q_norm"), m.get("k_norm"))
                if any(type(n) is not type(qn) for n in new):
                    return (f"because q_norm/k_norm were replaced by {type(new[0]).__name__}/"
                            f"{type(new[1]).__name__} modules that are not {type(qn).__name__}")
                self.norms = new
                qn, kn = new
            reason = _module_edit("q_norm", qn) or _module_edit("k_norm", kn)
            if reason is not None:
                return reason
            q_eps, k_eps = _norm_eps(qn), _norm_eps(kn)
            if q_eps != k_eps:
                return (f"because q_norm and k_norm have different eps ({q_eps} and {k_eps}), and the fused op "
                        f"normalises both with one")
        return (_module_edit("q_proj", q) or _module_edit("k_proj", k) or _module_edit("v_proj", v)
                or _global_hook_edit())

    def norm_weights(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The current q/k norm weights (None, None without QK-norm)."""
        return (self.norms[0].weight, self.norms[1].weight) if self.qk_norm else (None, None)

    def bound(self, attn: nn.Module, device: torch.device) -> ops.QKNormRope:
        """The layer's :class:`qkvfuse.QKNormRope`, built once per table, norm weights and eps: rebuilt when the
        model moves to another device, the table grows or is replaced (a new rotary module, or its scaling or mRoPE
        sections changed), a norm weight is replaced or changes storage (``weight.data = ...``, ``model.to(...)``)
        -- identity and data-pointer checks (:class:`qkvfuse.integrations._rebind.Rebinding`) -- or the norms' eps
        changed by value, so no stale table, weight, eps or recorded memory range."""
        table = self.rope.table(device)
        q_w, k_w = self.norm_weights()
        eps = float(_norm_eps(self.norms[0])) if self.qk_norm else 1e-6
        if torch.compiler.is_compiling():
            # Data pointers do not trace: one object per trace, on the tensors and the eps dynamo guards on.
            return self._build_split(table, q_w, k_w, eps)
        if self._bound is None:
            self._bound = Rebinding(self._build_split)
        self.eps = eps
        bound = self._bound.get(table, q_w, k_w)
        if bound.config.eps != eps:
            self._bound.clear()
            bound = self._bound.get(table, q_w, k_w)
        return bound

    def _build_split(self, table, q_w, k_w, eps: Optional[float] = None) -> ops.QKNormRope:
        return ops.QKNormRope(self.num_q_heads, self.num_kv_heads, self.head_dim, table, q_weight=q_w, k_weight=k_w,
                              eps=self.eps if eps is None else eps, is_neox=True,
                              mrope_section=self.rope.mrope_section,
                              mrope_interleaved=self.rope.mrope_interleaved, q_gate=self.q_gate,
                              gemma_norm=self.gemma_norm, backend=self.backend)

    def needs_autograd(self, attn: nn.Module, hidden_states: torch.Tensor) -> bool:
        """Whether this call must build an autograd graph (the fused ops are inference only)."""
        if not torch.is_grad_enabled():
            return False
        params = [p for proj in self.projections for p in (proj.weight, proj.bias) if p is not None]
        params += [w for w in self.norm_weights() if w is not None]
        return hidden_states.requires_grad or any(p.requires_grad for p in params)

    def fuse(self) -> None:
        """Concatenate q/k/v weights (and biases) and make each projection's parameters views into them."""
        with torch.no_grad():
            self.weight = torch.cat([p.weight.detach() for p in self.projections], dim=0)
            for proj, view in zip(self.projections, self.weight.split(self.widths, dim=0)):
                proj.weight.data = view
            self.bias = None
            if any(p.bias is not None for p in self.projections):
                self.bias = torch.cat([p.bias.detach() if p.bias is not None else self.weight.new_zeros(w)
                                       for p, w in zip(self.projections, self.widths)])
                for proj, view in zip(self.projections, self.bias.split(self.widths)):
                    if proj.bias is not None:
                        proj.bias.data = view
        self.params = tuple(p.weight for p in self.projections) + tuple(p.bias for p in self.projections)

    def unfuse(self) -> None:
        """Give each projection its own contiguous weight (and bias) again, with the same values."""
        with torch.no_grad():
            for proj in self.projections:
                proj.weight.data = proj.weight.data.clone()
                if proj.bias is not None:
                    proj.bias.data = proj.bias.data.clone()
        self.weight = self.bias = None
        self.params = ()

    def _views_intact(self) -> bool:
        w_offset = b_offset = 0
        params = self.params
        for i, (proj, width) in enumerate(zip(self.projections, self.widths)):
            weight, bias = proj.weight, proj.bias
            if weight is not params[i] or bias is not params[3 + i]:  # a parameter replaced or removed
                return False
            for param, fused, offset in ((weight, self.weight, w_offset), (bias, self.bias, b_offset)):
                if param is None:
                    continue
                if (fused is None or param.dtype != fused.dtype or param.device != fused.device
                        or param.data_ptr() != fused.data_ptr() + offset * param.element_size()):
                    return False
            w_offset += width * proj.in_features
            b_offset += width
        return True

    def qkv_params(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The fused weight and bias, re-derived first if a parameter was replaced or moved (``model.to``,
        ``proj.weight = ...``, ``weight.data = ...``): the views are checked by data pointer."""
        if not self._views_intact():
            self.fuse()
        return self.weight, self.bias

    def traced_qkv_params(self) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Under torch.compile: the fused weight and bias while the projections hold the parameter objects they
        were derived from in the fused weight's dtype and device (dynamo guards on both, so replacing a parameter
        or casting the model recompiles), else None (three GEMMs)."""
        weight = self.weight
        for proj, w, b in zip(self.projections, self.params[:3], self.params[3:]):
            if (proj.weight is not w or proj.bias is not b or proj.weight.dtype != weight.dtype
                    or proj.weight.device != weight.device):
                return None
        return weight, self.bias


def _fused_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                             past_key_values=None, **kwargs):
    """Attention with one QKV GEMM and one fused split + QK-RMSNorm + RoPE/mRoPE (``functools.partial(fn, attn)``
    as the instance's ``forward``).

    ``position_embeddings`` (transformers' cos/sin, rounded to the activation dtype) is not used: the fused op
    reads the fp32 table at the positions the rotary module received. A call the fused path cannot honour
    (autograd, a replaced/wrapped/hooked projection or norm, a dtype the ops do not take) runs the class's own
    forward, with one warning.
    """
    fused: _FusedAttention = self._qkvfuse
    compiling = torch.compiler.is_compiling()
    if compiling:
        _trace_time_sync(fused, self)
    reason = _AUTOGRAD if fused.needs_autograd(self, hidden_states) else fused.edit(self)
    if reason is not None:
        _warn_unfused(type(self).__name__, reason)
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)
    rope = fused.rope
    input_shape = hidden_states.shape[:-1]
    batch, seq = (1, input_shape[0]) if len(input_shape) == 1 else input_shape
    hq, hkv, d = fused.num_q_heads, fused.num_kv_heads, fused.head_dim
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    params = fused.traced_qkv_params() if compiling else fused.qkv_params()
    if params is None:
        # Compiled after a parameter was replaced or cast, before the trace-time sync could re-derive the fused
        # weight: each projection's own current parameters.
        qkv = torch.cat([F.linear(flat, p.weight, p.bias) for p in fused.projections], dim=-1)
    else:
        qkv = F.linear(flat, *params)  # [B*T, (Hq + 2Hkv) * D], gated [B*T, (2Hq + 2Hkv) * D]
    if not _serves(qkv.dtype, fused.norm_weights()):
        # Judged on qkv: under autocast it is the low-precision dtype the fused prepare serves.
        _warn_unfused(fused.model_name, _DTYPE.format(dtype=qkv.dtype))
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)
    positions = _flat_positions(rope.captured, batch, seq, rope.mrope_section is not None)
    q, k, v, *gate = fused.bound(self, qkv.device).inplace(qkv, positions)  # gated: the gate's column view too
    # Views into qkv (row stride = its width) reshaped to transformers' [B, H, T, D].
    query_states = q.view(*input_shape, hq, d).transpose(-3, -2)
    key_states = k.view(*input_shape, hkv, d).transpose(-3, -2)
    value_states = v.view(*input_shape, hkv, d).transpose(-3, -2)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, fused.eager)
    extra = {"sliding_window": self.sliding_window} if fused.sliding_window else {}
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **extra, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate:  # Qwen3-Next / Qwen3.5: the model's output gate, as its own forward applies it
        attn_output = attn_output * torch.sigmoid(gate[0].view(*input_shape, -1))
    return self.o_proj(attn_output), attn_weights


# --------------------------------------------------------------------------------------------------------
# The patched decoder layer: residual add after attention + post-attention RMSNorm in one call.
# --------------------------------------------------------------------------------------------------------
class _FusedLayer:
    """Per-decoder-layer state: the post-attention norm the fused add+norm stands in for, and its bound op."""

    def __init__(self, layer: nn.Module, backend: Optional[str], gemma_norm: bool = False, model_name: str = ""):
        self.model_name = model_name  # the text model's class, named by the one warning for an unserved dtype
        names = tuple(inspect.signature(type(layer).forward).parameters)[2:]
        # The original forward's parameters after hidden_states, for positional calls.
        self.arg_names: Tuple[str, ...] = tuple(n for n in names if n not in ("args", "kwargs"))
        self.backend = backend
        self.gemma_norm = gemma_norm
        self.linear = _attention_of(layer) is None  # a Gated DeltaNet layer: its linear_attn mixes the tokens
        self.norm: nn.Module = layer.post_attention_layernorm
        self._bound: Optional[Rebinding] = None  # the norm's AddRMSNorm, rebuilt when its weight changes

    def __getstate__(self):
        return {**self.__dict__, "_bound": None}

    def edit(self, layer: nn.Module) -> Optional[str]:
        """Why this call cannot fuse the add+norm, or None (identity and dict-emptiness checks only); a norm
        replaced by one of the same class is adopted."""
        norm = layer._modules.get("post_attention_layernorm")
        if norm is not self.norm:
            if type(norm) is not type(self.norm):
                return (f"because post_attention_layernorm was replaced by a {type(norm).__name__}, not a "
                        f"{type(self.norm).__name__}")
            self.norm = norm
        if layer.training and torch.is_grad_enabled() and getattr(layer, "gradient_checkpointing", False):
            return _CHECKPOINTING
        return _module_edit("post_attention_layernorm", norm) or _global_hook_edit()

    def bound(self, norm: nn.Module) -> ops.AddRMSNorm:
        """The layer's :class:`qkvfuse.AddRMSNorm`, rebuilt when the norm module or its weight is replaced, the
        weight changes storage (``weight.data = ...``, ``model.to(...)``) or the eps changes."""
        if torch.compiler.is_compiling():
            return self._build_norm(norm, norm.weight)  # one object per trace (data pointers do not trace)
        if self._bound is None:
            self._bound = Rebinding(self._build_norm)
        bound = self._bound.get(norm, norm.weight)
        if bound.config.eps != _norm_eps(norm):
            self._bound.clear()
            bound = self._bound.get(norm, norm.weight)
        return bound

    def _build_norm(self, norm, weight) -> ops.AddRMSNorm:
        return ops.AddRMSNorm(weight, _norm_eps(norm), gemma_norm=self.gemma_norm, backend=self.backend)

    def mix(self, layer: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The layer's token mixer, called as the layer's own forward calls it: ``self_attn`` (patched or not), or
        the Gated DeltaNet ``linear_attn`` of Qwen3-Next / Qwen3.5 (never patched), which takes the cache as
        ``cache_params`` and no positions."""
        if not self.linear:
            return layer.self_attn(hidden_states=hidden_states, **kwargs)[0]
        rest = {k: v for k, v in kwargs.items() if k not in _ATTENTION_ONLY}
        return layer.linear_attn(hidden_states=hidden_states, cache_params=kwargs.get("past_key_values"),
                                 attention_mask=kwargs.get("attention_mask"), **rest)


_ATTENTION_ONLY = ("past_key_values", "attention_mask", "position_ids", "position_embeddings")


_warned_unfused: set = set()
_AUTOGRAD = ("while autograd records (grad mode on and an input or parameter requires grad): the fused ops are "
             "inference only. Run under torch.no_grad() or torch.inference_mode() for the fused path.")
_CHECKPOINTING = ("while gradient checkpointing is on in training mode (grad mode on): the layer's own "
                  "checkpointed forward runs (its attention decides for itself).")
_AUTOCAST = ("(residual add + post-attention RMSNorm) under torch.autocast: autocast makes the attention output "
             "low-precision while the residual stream stays in the weights' dtype, and transformers adds them with "
             "type promotion, which the fused add+norm (equal dtypes) does not; the fused attention prepare still "
             "runs. Disable autocast (load the model in the dtype you want) for the fused add+norm.")
_DTYPE = ("for activations of dtype {dtype}, which the fused ops do not take with this model's norm weights (they "
          "take torch.float32, torch.bfloat16 or torch.float16, with fp32 norm weights or norm weights of the "
          "activations' dtype). Cast the model to one of those for the fused path.")
_MIXED = ("(residual add + post-attention RMSNorm) for an attention output of dtype {x} and a residual of dtype "
          "{r}: transformers adds them with type promotion, which the fused add+norm (equal dtypes) does not.")


def _warn_unfused(where: str, reason: str = _AUTOGRAD) -> None:
    """One RuntimeWarning per layer class and reason that a patched layer ran transformers' unfused code."""
    key = (where, reason)
    if key not in _warned_unfused:
        _warned_unfused.add(key)
        warnings.warn(f"qkvfuse: {where} runs transformers' unfused code {reason}", RuntimeWarning, stacklevel=3)


def _fused_decoder_forward(self, hidden_states, *args, **kwargs):
    """Decoder layer whose post-attention residual add and RMSNorm are one ``add_rmsnorm`` (``functools.partial``
    as the instance's ``forward``).

    Fusion stays inside the layer: Qwen3-VL adds DeepStack features to the hidden states between layers.
    """
    fused: _FusedLayer = self._qkvfuse
    reason = fused.edit(self)
    if reason is None and torch.is_grad_enabled() and (hidden_states.requires_grad
                                                       or fused.norm.weight.requires_grad):
        reason = _AUTOGRAD
    if reason is None and torch.is_autocast_enabled(hidden_states.device.type):
        # The whole layer's own code (its attention stays the patched one): under autocast transformers adds a
        # low-precision attention output to an fp32 residual with type promotion and normalises in fp32.
        reason = _AUTOCAST
    where = type(self).__name__
    if reason is None and not _serves(hidden_states.dtype, (fused.norm.weight,)):
        # e.g. model.double() after patching. The attention decides for itself, under the same warning: one per
        # model and dtype.
        where, reason = fused.model_name, _DTYPE.format(dtype=hidden_states.dtype)
    if reason is not None:
        _warn_unfused(where, reason)
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if args:
        kwargs.update(zip(fused.arg_names, args))
    norm = fused.norm
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states = fused.mix(self, hidden_states, kwargs)
    if hidden_states.dtype != residual.dtype or (torch.is_grad_enabled() and hidden_states.requires_grad):
        # Exactly the unpatched layer's add (type promotion) and norm: mixed dtypes, or an attention output that
        # records autograd (e.g. a LoRA adapter on the projections of a frozen model).
        _warn_unfused(type(self).__name__, _MIXED.format(x=hidden_states.dtype, r=residual.dtype)
                      if hidden_states.dtype != residual.dtype else _AUTOGRAD)
        residual = residual + hidden_states
        return residual + self.mlp(norm(residual))
    shape = hidden_states.shape
    normed, residual = fused.bound(norm)(hidden_states.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]))
    hidden_states = self.mlp(normed.view(shape))
    return residual.view(shape) + hidden_states


# --------------------------------------------------------------------------------------------------------
# apply / remove.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _PatchState:
    """What one :func:`apply_qkvfuse` call changed (kept on the patched model as ``_qkvfuse_patch``)."""

    options: Tuple
    owner: Optional[nn.Module] = None  # the model apply_qkvfuse was called on
    text_models: List[nn.Module] = dataclasses.field(default_factory=list)
    attentions: List[nn.Module] = dataclasses.field(default_factory=list)
    layers: List[nn.Module] = dataclasses.field(default_factory=list)
    rotaries: List[nn.Module] = dataclasses.field(default_factory=list)
    hooks: List = dataclasses.field(default_factory=list)
    moe_blocks: List[nn.Module] = dataclasses.field(default_factory=list)


def _supported_list() -> str:
    by_family: Dict[_Family, List[str]] = {}
    for model_type, family in SUPPORTED_MODELS.items():
        by_family.setdefault(family, []).append(model_type)
    return "; ".join([f"{'/'.join(types_)} ({', '.join(f.classes)})" for f, types_ in by_family.items()]
                     + [f"{t} (with a text_config of one of these)" for t in BY_TEXT_CONFIG])


def _family_of(model: nn.Module) -> _Family:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in BY_TEXT_CONFIG:
        text_type = getattr(getattr(config, "text_config", None), "model_type", None)
        family = SUPPORTED_MODELS.get(text_type) if isinstance(text_type, str) else None
        if family is None:
            raise TypeError(f"apply_qkvfuse: {type(model).__name__} (config.model_type={model_type!r}) is supported "
                            f"when its text model is, and text_config.model_type={text_type!r} is not; supported "
                            f"config.model_type values: {_supported_list()}")
        return family
    family = SUPPORTED_MODELS.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise TypeError(f"apply_qkvfuse: {type(model).__name__} (config.model_type={model_type!r}) is not supported; "
                        f"supported config.model_type values (and their transformers classes, subclasses "
                        f"included): {_supported_list()}")
    return family


def _base(cls: type, name: str) -> Optional[type]:
    """The class named ``name`` in ``cls``'s MRO (``cls`` itself or a base), or None."""
    return next((c for c in cls.__mro__ if c.__name__ == name), None)


def _text_models(model: nn.Module, family: _Family) -> List[nn.Module]:
    found = [m for m in model.modules() if _base(type(m), family.text_model) is not None]
    if not found:
        raise TypeError(f"apply_qkvfuse: no {family.text_model} found inside {type(model).__name__}")
    return found


def _own_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` is one of this patch's (``functools.partial`` of a patched forward)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in _PATCHED_FORWARDS


def _check_forward(module: nn.Module, base: type, what: str) -> None:
    """The patch replaces ``base.forward``: refuse a subclass that overrides it, or a forward set on the instance by
    someone else (another patcher), rather than silently dropping it."""
    if inspect.unwrap(type(module).forward) is not inspect.unwrap(base.forward):
        raise TypeError(f"apply_qkvfuse: {what} {type(module).__name__} overrides {base.__name__}.forward, which "
                        f"qkvfuse replaces; patch the unmodified class")
    if "forward" in module.__dict__ and not _own_forward(module):
        raise TypeError(f"apply_qkvfuse: {what} {type(module).__name__} has a forward set on the instance (patched "
                        f"by another tool?), which qkvfuse would replace; undo that patch first")


def _check_layer(layer: nn.Module, family: _Family) -> None:
    base_layer = _base(type(layer), family.decoder_layer)
    if base_layer is None:
        raise TypeError(f"apply_qkvfuse: expected decoder layers of class {family.decoder_layer} (or a subclass), "
                        f"found {type(layer).__name__}")
    _check_forward(layer, base_layer, "decoder layer")
    attn = _attention_of(layer)
    if attn is None and family.linear_attention is not None:
        mixer = layer._modules.get("linear_attn")
        if _base(type(mixer), family.linear_attention) is None:
            raise TypeError(f"apply_qkvfuse: expected a self_attn of class {family.attention} or a linear_attn of "
                            f"class {family.linear_attention} (or subclasses), found {type(mixer).__name__}")
        return
    base_attn = _base(type(attn), family.attention)
    if base_attn is None:
        raise TypeError(f"apply_qkvfuse: expected attention of class {family.attention} (or a subclass), found "
                        f"{type(attn).__name__}")
    _check_forward(attn, base_attn, "attention")


def _overlap_requested(shared_expert_overlap: Optional[bool]) -> Optional[bool]:
    """True/False: patch the GLM MoE blocks with that setting; None: leave them alone."""
    if shared_expert_overlap is not None:
        if not isinstance(shared_expert_overlap, bool):
            raise TypeError(f"shared_expert_overlap: expected a bool or None, got {shared_expert_overlap!r}")
        return shared_expert_overlap
    if not os.environ.get(_OVERLAP_ENV, "").strip():
        return None
    # The environment switch is parsed by qkvfuse.moe, the one place that defines it.
    return True if _glm4_moe_api().overlap_enabled(None) else None


def _glm4_moe_api():
    try:
        from ..moe import glm4, overlap
    except ImportError as exc:
        raise NotImplementedError(
            f"apply_qkvfuse: shared-expert overlap needs qkvfuse.moe.glm4 (patch_glm4_moe), which is not available "
            f"in this qkvfuse ({exc}); pass shared_expert_overlap=None and unset {_OVERLAP_ENV}") from None
    return types.SimpleNamespace(patch=glm4.patch_glm4_moe, unpatch=glm4.unpatch_glm4_moe,
                                 is_block=glm4.is_glm4_moe_block, overlap_enabled=overlap.overlap_enabled)


def _patch_moe(model: nn.Module, overlap: bool, explicit: bool) -> List[nn.Module]:
    api = _glm4_moe_api()
    blocks = [m for m in model.modules() if api.is_block(m)]
    if not blocks and explicit:
        raise ValueError(f"apply_qkvfuse: shared_expert_overlap applies to GLM-4 MoE blocks with a shared expert; "
                         f"{type(model).__name__} has none")
    # Without an explicit request the environment switch is global: models without shared experts ignore it.
    patched, untested = [], {}
    for block in blocks:
        reason = _untested(dict([_method(type(block), "forward")]))
        if reason is not None:
            untested.setdefault(type(block).__name__, reason)
            continue
        api.patch(block, overlap=overlap)
        patched.append(block)
    for cls, reason in untested.items():
        warnings.warn(f"apply_qkvfuse: {cls} keeps transformers' own forward: {reason}", RuntimeWarning, stacklevel=3)
    return patched


def _covering_states(model: nn.Module) -> List[_PatchState]:
    """The patches that cover ``model``: its own, one of a submodule (an inner model patched first) or one of an
    enclosing model (found through the text models it patched)."""
    states: Dict[int, _PatchState] = {}
    for module in model.modules():
        for state in (module.__dict__.get("_qkvfuse_patch"),
                      getattr(module.__dict__.get("_qkvfuse_rope"), "state", None)):
            if state is not None:
                states.setdefault(id(state), state)
    return list(states.values())


def is_patched(model: nn.Module) -> bool:
    """Whether ``model``'s attention layers run qkvfuse: :func:`apply_qkvfuse` patched it, a model inside it or a
    model around it (and :func:`remove_qkvfuse` has not undone that)."""
    return bool(_covering_states(model))


def apply_qkvfuse(model: nn.Module, *, backend: Optional[str] = None, fuse_add_rmsnorm: bool = True,
                  shared_expert_overlap: Optional[bool] = None) -> nn.Module:
    """Patch a transformers model in place to use qkvfuse's fused ops; returns the same model.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        One of :data:`SUPPORTED_MODELS` (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
        ``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``, ``Glm4MoeForCausalLM``,
        ``Glm4vMoeForConditionalGeneration``, ``Qwen3NextForCausalLM``, ``Qwen3_5ForConditionalGeneration`` /
        ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForConditionalGeneration`` / ``Qwen3_5MoeForCausalLM``, or their bare
        ``*Model`` classes; ``Glm46VForConditionalGeneration`` whose ``text_config`` is one of them, e.g.
        ``glm4v_moe_text``: :data:`BY_TEXT_CONFIG`), fp32/bf16/fp16, with plain ``nn.Linear`` q/k/v projections.
        Build bf16 models with ``dtype=torch.bfloat16`` at load time: ``model.to(torch.bfloat16)`` also
        downcasts GLM's fp32 router bias (a transformers behaviour; qkvfuse does not touch the router).
    backend : str, optional
        qkvfuse backend for both ops (``"reference"``, ``"cpu"``, ``"triton"``, ``"auto"``); default: what the
        public ops pick for the tensors' device (``QKVFUSE_BACKEND`` honoured).
    fuse_add_rmsnorm : bool
        Also replace each decoder layer's post-attention ``residual + x`` and RMSNorm by one ``add_rmsnorm``.
    shared_expert_overlap : bool, optional
        For GLM-4 MoE blocks (GLM-4.5/4.6/4.7, GLM-4.5V text), run the shared expert overlapped with the routed
        experts (True) or inline (False) through ``qkvfuse.moe.glm4.patch_glm4_moe``. None: leave the MoE
        blocks alone unless ``QKVFUSE_SHARED_EXPERT_OVERLAP`` enables it (models without such blocks then
        ignore the variable; an explicit True/False on them raises ``ValueError``).
    Returns
    -------
    model
        The same object, patched. What changes: each attention layer does one GEMM into a packed
        ``[B*T, (Hq + 2*Hkv) * head_dim]`` buffer (gated: ``(2*Hq + 2*Hkv) * head_dim``) and one fused split +
        QK-RMSNorm + RoPE/mRoPE over it, at the
        positions the model's rotary module receives, with an fp32 cos/sin table of ``max_position_embeddings``
        rows (positions must stay below it). q/k/v weights become views into one concatenated tensor.
        Calling it again with the same options does nothing but re-derive the fused weight if a projection's
        parameters changed storage (e.g. under ``torch.compile``, see the README); with other options it
        re-patches. Nesting is idempotent: patching ``model.model`` and then ``model`` (or the reverse) with the same
        options keeps the first patch; other options re-patch from the original model.

    Raises
    ------
    TypeError
        Unsupported ``config.model_type`` (the message lists the supported ones), a decoder layer or attention
        class that overrides the ``forward`` qkvfuse replaces (or carries another tool's instance ``forward``),
        a q/k/v projection that is not a plain ``torch.nn.Linear`` (quantised layers), or an unsupported dtype.
    NotImplementedError
        rope parameters qkvfuse cannot reproduce (e.g. dynamic NTK; mRoPE sections that do not sum to half the
        rotary dim), shared-expert overlap requested while ``qkvfuse.moe.glm4`` is unavailable, or an offloaded
        model (accelerate ``device_map`` with CPU/disk offload): a parameter or buffer on the ``meta`` device, a
        module carrying an accelerate hook (``_hf_hook``; any accelerate dispatch, since the patch replaces the
        forwards those hooks wrap), or an ``hf_device_map`` naming ``"disk"``, or ``"cpu"`` next to an
        accelerator. Checked before anything changes: the model stays unpatched and working.

    Warns
    -----
    RuntimeWarning
        A layer class whose transformers code is not a tested version (:data:`TESTED_SOURCES`) keeps its own
        forward: one warning per class, naming the function that differs.
    RuntimeWarning
        The rotary module's ``inv_freq`` is not fp32 (a model cast with ``.to(dtype)`` after loading): qkvfuse
        still rotates with the exact fp32 frequencies.
    """
    family = _family_of(model)
    _check_not_offloaded(model)
    overlap = _overlap_requested(shared_expert_overlap)
    options = (backend, bool(fuse_add_rmsnorm), overlap)
    text_models = _text_models(model, family)
    covering = _covering_states(model)
    if (len(covering) == 1 and covering[0].options == options
            and {id(m) for m in text_models} <= {id(m) for m in covering[0].text_models}):
        # Already patched so (by this call's model or one around it): keep it, re-derive stale fused weights.
        for attn in covering[0].attentions:
            attn._qkvfuse.qkv_params()
        return model
    device = next(model.parameters()).device
    resolve_backend(backend, device.type)  # an invalid or unavailable explicit backend fails here, not mid-forward

    # Validate everything before changing anything, so a failure leaves the model untouched. A patched forward
    # found here is undone below (re-patching), so only foreign ones are refused.
    plan = []
    untested: Dict[str, str] = {}  # layer class -> why it keeps transformers' code (one warning each)
    for text_model in text_models:
        rope = _Rope(text_model.rotary_emb, family.mrope_interleaved)
        if "forward" in text_model.rotary_emb.__dict__ and not _own_forward(text_model.rotary_emb):
            raise TypeError(f"apply_qkvfuse: {type(text_model.rotary_emb).__name__} has a forward set on the "
                            f"instance (patched by another tool?), which qkvfuse would replace")
        fused_layers = []
        for layer in text_model.layers:
            _check_layer(layer, family)
            attn = _attention_of(layer)
            if attn is not None:
                _validate_attention(attn)
                reason = _untested(_attention_sources(attn, text_model.rotary_emb, family))
                if reason is not None:
                    untested.setdefault(type(attn).__name__, reason)
                    attn = None
            reason = _untested(_layer_sources(layer)) if fuse_add_rmsnorm else None
            if reason is not None:
                untested.setdefault(type(layer).__name__, reason)
            fused_layers.append((layer, attn, fuse_add_rmsnorm and reason is None))
        plan.append((text_model, rope, fused_layers))
    for state in covering:  # other options, or an inner model patched first: re-patch from the original model
        _remove_state(state)

    for cls, reason in untested.items():
        warnings.warn(f"apply_qkvfuse: {cls} keeps transformers' own forward: {reason}", RuntimeWarning,
                      stacklevel=2)
    state = _PatchState(options, owner=model)
    for text_model, rope, fused_layers in plan:
        eager = getattr(sys.modules[_base(type(text_model.layers[0]), family.decoder_layer).__module__],
                        "eager_attention_forward")
        rope.state = state
        rope.prebuild()
        model_name = type(text_model).__name__
        rotary = text_model.rotary_emb
        # Plain attributes (not submodules), shared by the rotary forward and the text model's clearing hook.
        text_model._qkvfuse_rope = rotary._qkvfuse_rope = rope
        rotary.forward = functools.partial(_capturing_rotary_forward, rotary)
        state.text_models.append(text_model)
        state.rotaries.append(rotary)
        state.hooks.append(text_model.register_forward_hook(_clear_positions, always_call=True))
        state.hooks.append(text_model.register_forward_pre_hook(_follow_rotary))
        for layer, attn, fuse_layer in fused_layers:
            if attn is not None:
                attn._qkvfuse = _FusedAttention(attn, rope, backend, eager, family, model_name)
                attn.forward = functools.partial(_fused_attention_forward, attn)
                state.attentions.append(attn)
            if fuse_layer:
                layer._qkvfuse = _FusedLayer(layer, backend, family.gemma_norm, model_name)
                layer.forward = functools.partial(_fused_decoder_forward, layer)
                state.layers.append(layer)
    model._qkvfuse_patch = state
    if overlap is not None:
        try:
            state.moe_blocks = _patch_moe(model, overlap, explicit=shared_expert_overlap is not None)
        except Exception:
            remove_qkvfuse(model)
            raise
    return model


def _offload_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` looks offloaded or dispatched by accelerate, or None."""
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in tensors:
            if tensor.is_meta:
                return f"{kind} {name} is on the meta device"
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            return f"module {name or type(model).__name__} carries an accelerate hook (_hf_hook)"
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict):
        devices = {str(d) for d in device_map.values()}
        if "disk" in devices or ("cpu" in devices and devices - {"cpu"}):
            return f"hf_device_map places modules on {sorted(devices)}"
    return None


def _check_not_offloaded(model: nn.Module) -> None:
    reason = _offload_reason(model)
    if reason is not None:
        raise NotImplementedError(
            f"apply_qkvfuse: the model is offloaded or dispatched by accelerate ({reason}): device_map with CPU/disk "
            f"offload keeps parameters on the meta device and materialises them per forward through hooks; "
            f"qkvfuse fuses materialised weights only and replaces the forwards those hooks wrap - load the model "
            f"without offloading (no device_map, or one device)")


def _validate_attention(attn: nn.Module) -> None:
    for name in ("q_proj", "k_proj", "v_proj"):
        proj = getattr(attn, name, None)
        if not _is_plain_linear(proj):
            raise TypeError(
                f"apply_qkvfuse: {type(attn).__name__}.{name} is a {type(proj).__module__}.{type(proj).__name__}, "
                f"not torch.nn.Linear; qkvfuse fuses plain (unquantised) projections of the supported models "
                f"only: {', '.join(SUPPORTED_MODELS)}")
        if proj.weight.dtype not in _FUSABLE_DTYPES:
            raise TypeError(f"apply_qkvfuse: {name}.weight has dtype {proj.weight.dtype}; expected one of "
                            f"{list(_FUSABLE_DTYPES)}")


def remove_qkvfuse(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_qkvfuse`: original forwards, separate q/k/v weights with unchanged values.

    The model then computes bit-identical outputs to before the patch. Whichever model was patched (this one, a
    model inside it, or one around it), the patch covering this model's attention layers is undone. A model that
    is not patched is returned unchanged.
    """
    for state in _covering_states(model):
        _remove_state(state)
    return model


def _remove_state(state: _PatchState) -> None:
    if state.moe_blocks:
        unpatch = _glm4_moe_api().unpatch
        for block in state.moe_blocks:
            unpatch(block)
    for hook in state.hooks:
        hook.remove()
    for rotary in state.rotaries:
        del rotary.forward
        del rotary._qkvfuse_rope
    for text_model in state.text_models:
        del text_model._qkvfuse_rope
    for attn in state.attentions:
        attn._qkvfuse.unfuse()
        del attn.forward
        del attn._qkvfuse
    for layer in state.layers:
        del layer.forward
        del layer._qkvfuse
    del state.owner._qkvfuse_patch


_PATCHED_FORWARDS = (_capturing_rotary_forward, _fused_attention_forward, _fused_decoder_forward)
