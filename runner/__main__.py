"""``python -m ckrun``: the same as the ``ckrun`` console script."""

from ckrun.cli import main

if __name__ == "__main__":
    main()
