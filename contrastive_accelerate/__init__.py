"""The trainer's supporting pieces, under one name unique to this project.

``trainer``, ``losses`` and ``models`` are the layout's top-level names;
everything else lives here so that a user's own ``data.py`` or ``utils/`` cannot
shadow it (and it cannot shadow theirs)::

    from contrastive_accelerate.data import GlobalBatchSampler, TwoViews, load_image_dataset
    from contrastive_accelerate.optim import LARS
    from contrastive_accelerate.ckpt_diff import max_abs_diff
"""
