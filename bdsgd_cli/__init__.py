"""Command-line interface of bdsgd: thin click commands over ``stages``."""
