"""Generated wire-contract code (see scripts/gen_protos.py); do not edit."""
