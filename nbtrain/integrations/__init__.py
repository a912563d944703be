"""Bridges to other tools. Submodules are imported explicitly (``nbtrain.integrations.hf``) so that
``import nbtrain`` never pulls in their dependencies."""
