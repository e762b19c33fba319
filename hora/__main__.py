"""``python -m hora run -np 2 python train.py``: the same as the ``hora`` command."""

from hora.runner.launch import cli

if __name__ == "__main__":
    cli()
