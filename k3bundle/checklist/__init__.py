"""``k3bundle checklist``: what a target must prove, with numbers computed from the plan.

``make_checklist(target, config=None, bundle=None, context, batch, serving=Serving(...))`` returns a
``Checklist``: capacity (``capacity.py``, in the engine's terms: ``serving.py``; its prefix-cache and
prefill/decode handoff budgets: ``cache_budget.py``), roofline lower bounds (``roofline.py``), kernel coverage
(``kernels.py``), fault paths and soak (``faults.py``) and the sign-off stages, each ticked only
from evidence (``stages.py``). ``render.to_markdown`` and ``html.to_html`` (a page, with each
kernel's conformance from the sign-off: ``conformance.py``) are for people, ``Checklist.to_dict``
for machines; ``write.write_checklist`` writes all three. docs/bring-up.md explains every number.
"""

from k3bundle.checklist.build import CHECKLIST_KIND, DEFAULT_BATCH, DEFAULT_CONTEXT, Checklist, make_checklist
from k3bundle.checklist.capacity import CAPACITY_MARGIN, Capacity, capacity
from k3bundle.checklist.errors import ChecklistError
from k3bundle.checklist.render import to_markdown
from k3bundle.checklist.roofline import Roofline, roofline
from k3bundle.checklist.serving import Serving
from k3bundle.checklist.stages import REQUIRED_CASE_KINDS, Stage
from k3bundle.checklist.write import save_checklist, write_checklist

__all__ = ["CAPACITY_MARGIN", "CHECKLIST_KIND", "Capacity", "Checklist", "ChecklistError", "DEFAULT_BATCH",
           "DEFAULT_CONTEXT", "REQUIRED_CASE_KINDS", "Roofline", "Serving", "Stage", "capacity", "make_checklist", "roofline",
           "save_checklist", "to_markdown", "write_checklist"]
