"""``k3bundle convert``: stream a source checkpoint into a per-device bundle for one layout.

``convert(source, target, out, workers)`` (``k3bundle.convert.run``) plans the layout, converts
each source file in one sequential read (``k3bundle.convert.unit``), resumes from a journal
(``k3bundle.convert.journal``) and writes the manifest last (``k3bundle.convert.manifest``).
"""

from k3bundle.convert.errors import ConvertError
from k3bundle.convert.run import ConvertResult, convert

__all__ = ["ConvertError", "ConvertResult", "convert"]
