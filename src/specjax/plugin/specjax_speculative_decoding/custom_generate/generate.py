"""specjax's speculative decoding as a transformers ``custom_generate`` repository.

``target.generate(input_ids, assistant_model=draft, streamer=streamer,
custom_generate=specjax.plugin.hf.CUSTOM_GENERATE_DIR, trust_remote_code=True)``
loads this file; transformers then calls ``generate(model=target, **every
generate argument)``. It is :func:`specjax.plugin.custom_generate.generate_with_all_arguments`.
"""

from specjax.plugin.custom_generate import generate_with_all_arguments as generate

__all__ = ["generate"]
