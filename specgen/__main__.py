"""`python -m specgen`: the same command line as the `specgen` script."""
from specgen.cli import main

# Guarded: worker processes started with multiprocessing's spawn import this module again (as __mp_main__).
if __name__ == "__main__":
    main()
