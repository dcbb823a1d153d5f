"""pagellm on AMD GPUs: the ``rocm`` platform plugin (``pagellm_rocm.plugin``).

Importing this package imports nothing heavy; the platform class lives in `pagellm_rocm.platform`
and is imported by the core only when the plugin reports an AMD GPU. It has never run on AMD
hardware: see the package README for what was verified and how.
"""
