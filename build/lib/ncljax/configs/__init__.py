"""The shipped config files: one ``get_config(arg)`` file per method (and the quickstart).

They ship inside the package, so an installed ncljax trains without a checkout. Pass one
by name or by path, with its argument after a colon::

    ncljax train --config=gsc:vectors --config.data.folder=DIR
    python train.py --config=configs/gsc.py:vectors ...      # a checkout: the same file

``ncljax.config.files`` finds them (``names()``, ``resolve``); ``configs/`` at the root of
a checkout is a link to this folder.
"""
