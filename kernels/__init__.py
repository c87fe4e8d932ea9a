"""Matrix-sign kernels. Torch implementation for now; a Triton path slots in behind `msign`."""
from kernels.msign_torch import msign_torch, orthonormalize_near

def msign(X, steps=5, polish_steps=0):
    return msign_torch(X, steps=steps, polish_steps=polish_steps)
