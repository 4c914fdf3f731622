"""What the tests share: imported as ``tests.helpers.<module>`` (pytest puts the checkout's
root on ``sys.path``: ``pythonpath`` in pyproject.toml).

* :mod:`.harness`  -- ``run_ranks``: a function on N local gloo ranks (the pooled processes
  of :mod:`hybrid.testing.pool`)
* :mod:`.launch`   -- ``pretrain_gpt.py`` run as a user would: pooled (``pretrain``) or under
  torchrun, and the processes it starts
* :mod:`.zero_reference` -- the one-process references the ZeRO tests compare with
* :mod:`.checkpoint_io_session` -- the 4-process checkpoint I/O session two files share
"""
