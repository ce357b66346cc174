"""Tile sizes of the hybrid training kernels (ell.py and backup.py): GPU ones for speed; small ones in the CPU
interpreter so that small test shapes still run every loop several times."""

GPU_BLOCKS = dict(BLOCK_M=64, BLOCK_I=64, PACK_WARPS=4, SDDMM_S=4, SDDMM_D=1024,
                  BLOCK_S=4, BLOCK_D=2048, BLOCK_N=4, SEG=512, FUSE_D=2048, BACKUP=(64, 64, 64), NPROG=528)
CPU_BLOCKS = dict(BLOCK_M=16, BLOCK_I=32, PACK_WARPS=4, SDDMM_S=4, SDDMM_D=16, BLOCK_S=4,
                  BLOCK_D=16, BLOCK_N=4, SEG=8, FUSE_D=64, BACKUP=(16, 16, 16), NPROG=3)


def blocks(device):
    return GPU_BLOCKS if device.type == "cuda" else CPU_BLOCKS
