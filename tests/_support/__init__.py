"""Helpers of the test suite that are not tests (no test module imports another test module).

* :mod:`.child_records` -- run a ``qkvfuse._verify`` catalogue in a child process and read its JSON records;
* :mod:`.moe_stream_fakes` -- a recording fake device module for the shared-expert overlap's stream protocol;
* :mod:`.cases` -- one split configuration run and checked under the accuracy rule (:func:`.cases.run_split_case`);
* :mod:`.bits` -- bitwise comparison of op outputs (:func:`.bits.assert_bitwise`).

``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so test modules import these as ``from _support... import``.
"""
