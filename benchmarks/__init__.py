"""The benchmarks: what measures the product and is not the product (docs/design.md §13).

Run from a checkout, not shipped in the wheel: ``python -m benchmarks <subcommand> [mode] ...``
(``__main__``; ``--help`` lists the subcommands, and each subcommand its modes). The models
they measure on come from ``tests/models/`` (the zoo, the ONNX node-test corpus, the hot and
control-flow models, the decoders); here are the commands, ``peers`` (the converters we
measure against), ``chains`` (synthetic speed models) and ``timing`` (host probe,
round-robin repeats). The product (``amp_rewrite``) never imports this package
(tests/test_layout.py).
"""
