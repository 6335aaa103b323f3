"""Callbacks that attach gradwatch to a training framework's loop.

Each submodule imports its framework, so importing this package imports
none of them; import the one you use. Install both with
``pip install 'gradwatch[integrations]'``.

Example::

    from transformers import Trainer
    from gradwatch.integrations.transformers import GradwatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GradwatchCallback(endpoint="tcp://collector:5555")])

    import lightning.pytorch as pl
    from gradwatch.integrations.lightning import GradwatchCallback

    pl.Trainer(callbacks=[GradwatchCallback(job="run-42", endpoint="tcp://collector:5555")])

See docs/integrations.md for what each callback reads, when, and its limits.
"""
