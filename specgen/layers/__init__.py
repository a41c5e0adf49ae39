"""The layers a decoder is made of (linear, norm, rotary embedding, attention, the decoder block, the LM
head), as typed weights and their Paddle reference implementations, which run on any device Paddle runs on.
The fused CPU backend (specgen/backends/fused.py) computes the same functions in its kernels."""
