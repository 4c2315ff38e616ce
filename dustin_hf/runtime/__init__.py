"""How the decoding loop runs on a GPU: CUDA graphs of its fixed-shape forwards, fused decode ops, launch settings.

Nothing here changes what is computed; it changes how many launches it takes and how they are issued.
"""
