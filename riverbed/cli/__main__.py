"""``python -m riverbed.cli``."""

from riverbed.cli import main

if __name__ == "__main__":
    main()
