"""``python -m ckrun.cli``: the same entry point as the ``ckrun`` console script."""

from ckrun.cli.main import main

if __name__ == "__main__":
    main()
