"""``k3bundle convert``: stream a source checkpoint into a per-device bundle for one layout.

``convert(source, target, out, workers)`` (``k3bundle.convert.run``) plans the layout, converts
each source file in one sequential read (``k3bundle.convert.unit``), resumes from a journal
(``k3bundle.convert.journal``) and writes the manifest last.
"""

from k3bundle.convert.run import ConvertResult, convert, plan_for_source
from k3bundle.convert.unit import ConvertError

__all__ = ["ConvertError", "ConvertResult", "convert", "plan_for_source"]
