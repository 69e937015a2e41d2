"""Every version and format tag smpckpt writes into checkpoints, in one place.

Each versions one thing and moves on its own; all are pinned by ``tests/test_golden.py`` (a tag never
follows a code move). Readers accept every older value listed here.

============================ ========================= ===================================================
name                         where it is written       what it versions
============================ ========================= ===================================================
``FORMAT_VERSION``           manifest ``format_version`` the manifest's layout (files, checks, units)
``RAW_DESCRIPTOR``           ``.metadata`` item         the raw tensor-bytes encoding of a stored item
                             transforms
``RECORD_VERSION``           ``LayoutRecord.version``   the recorded partition (layout, specs, ties)
``API_RECORD``               manifest ``extra["api"]``  what ``save_checkpoint`` stores besides tensors
``FULL_API_RECORD``          manifest ``extra["api"]``  the same for full artifacts (``partial=False``)
============================ ========================= ===================================================
"""

__all__ = ["FORMAT_VERSION", "RAW_DESCRIPTOR", "RECORD_VERSION", "API_RECORD", "API_RECORD_V1", "FULL_API_RECORD"]

#: Readers refuse manifests newer than they understand. A manifest is written with the lowest version
#: that describes it: 2 only when a file has tiled check units (which an older reader would misread as
#: corrupt), so checkpoints without them stay readable by 1.
FORMAT_VERSION = 2
#: Transform descriptor recorded on raw tensor items. A stock DCP reader does not know it and fails
#: with ``ValueError: Unknown extension name='smpckpt.raw'`` instead of decoding garbage.
RAW_DESCRIPTOR = "smpckpt.raw/1"
RECORD_VERSION = 1
#: Version 2 stores user_content as one ``torch.save`` record; version 1 (smpckpt 0.1.0) wrapped those
#: bytes in a second pickle, which resume still unwraps.
API_RECORD = "smpckpt.save_checkpoint/2"
API_RECORD_V1 = "smpckpt.save_checkpoint/1"
FULL_API_RECORD = "smpckpt.api.full/1"
