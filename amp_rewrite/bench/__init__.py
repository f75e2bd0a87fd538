"""What measures the product and is not the product (docs/design.md §13).

``zoo`` (real ``transformers`` architectures with random weights), ``corpus`` (the ONNX backend
node-test corpus runner and its judgement), ``peers`` (the converters we measure against) and
``measure`` (conversion counting and error metrics for torch graphs), ``chains`` (synthetic
speed models) and ``timing`` (host probe, round-robin repeats). ``python -m amp_rewrite.bench``
(``__main__``) runs every benchmark as a subcommand; ``tests/`` import these modules; the
adapters (``amp_rewrite.onnx``, ``amp_rewrite.fx``) never do.
"""
