"""The block kit families are built from (layers.py) on megatron-core tensor-parallel primitives, and
what a family is to the rest of scaletrain (family.py); the families themselves are in families/.

Importing this package loads neither torch nor megatron.
"""
