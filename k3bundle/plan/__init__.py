"""``k3bundle plan``: place every tensor on the ranks of a layout, from shapes alone.

``make_plan(config, layout)`` gives a ``Plan``: ``Target``s (role instance -> rank, slice,
storage format), per-rank bytes against the card, and the rules a layout breaks
(``LayoutError``). ``k3bundle.plan.files`` turns a plan into the bundle's files.
"""

from k3bundle.plan.placement import GROUPS, Plan, RankInfo, Target, make_plan, plan_for_source, role_group
from k3bundle.plan.storage import EXACT_TRANSFORMS, DevicePart, device_parts, storage_name

__all__ = ["DevicePart", "EXACT_TRANSFORMS", "GROUPS", "Plan", "RankInfo", "Target", "device_parts",
           "make_plan", "plan_for_source", "role_group", "storage_name"]
