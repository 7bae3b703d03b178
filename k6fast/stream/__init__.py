"""The DiT's weights from files to the device: the residency plan (`plan.py`, what stays and what streams under the
VRAM budget; no PyTorch), the read path (`reader.py`), the block streamer (`streamer.py`) and the runtime that puts
them together from a checkpoint's transformer files and config (`runtime.py`)."""
