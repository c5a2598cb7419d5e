"""Third-tier block stores (``kvkit.interfaces.BlockStore``): in-process, disk, Valkey/Redis."""
