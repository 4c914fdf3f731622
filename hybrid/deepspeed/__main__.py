"""``python -m hybrid.deepspeed``: the ``hybrid-deepspeed`` launcher
(:mod:`hybrid.deepspeed.launcher`), DeepSpeed's ``deepspeed`` command line."""

from hybrid.deepspeed.launcher import main

if __name__ == "__main__":
    main()
