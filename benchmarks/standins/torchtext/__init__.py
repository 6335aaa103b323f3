"""A stand-in for the few torchtext names pytorch/examples' ``language_translation`` imports.

torchtext (and spaCy, whose tokenizers it loads) is not installed here and Multi30k cannot
be downloaded: ``benchmarks/translation_trial.py`` puts ``benchmarks/standins`` first on
the script's ``PYTHONPATH`` so that this package answers ``torchtext.data.utils``,
``torchtext.vocab`` and ``torchtext.datasets`` (see ``benchmarks/standins/README.md``).
"""
