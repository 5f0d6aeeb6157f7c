"""The recipe's node-limited routing (``model.num_expert_groups`` / ``model.num_limited_groups``,
``launch/config/node_limited.py``) put into torchtitan's router: on 0.2.2 into the MoE args of
the flavor its ``Trainer`` builds (:func:`flavor_with_groups`), on 0.3.0 into every router
config of the model config (:func:`model_config_with_groups`). null (both) turns it off, also
where torchtitan's flavor turns it on; the flavor's own values are kept when they are the ones
asked for.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from launch.titan.models import NODE_LIMITED_VARIANT as VARIANT
from launch.titan.models import _flavor_dict, register_tiny_flavors

__all__ = ["flavor_with_groups", "model_config_with_groups", "variant_name"]


def variant_name(flavor: str, groups: Optional[int], limited: Optional[int]) -> str:
    """The name under which torchtitan 0.2.2 finds ``flavor`` with these groups."""
    return f"{flavor}{VARIANT}off" if groups is None else f"{flavor}{VARIANT}{groups},limited={limited}"


def flavor_with_groups(family: str, flavor: str, groups: Optional[int], limited: Optional[int]) -> str:
    """The torchtitan 0.2.2 flavor name of (``family``, ``flavor``) with node-limited routing
    ``groups`` / ``limited``: ``flavor`` itself when its MoE args have them, else a variant of
    its args added to torchtitan's flavor dict (``variant_name``). ``family`` and ``flavor`` are
    torchtitan's names (``launch.titan.models.resolve``)."""
    register_tiny_flavors()
    flavors = _flavor_dict(family)
    moe = flavors[flavor].moe_args
    if (moe.num_expert_groups, moe.num_limited_groups) == (groups, limited):
        return flavor
    name = variant_name(flavor, groups, limited)
    if name not in flavors:
        args = copy.deepcopy(flavors[flavor])
        args.moe_args = dataclasses.replace(moe, num_expert_groups=groups, num_limited_groups=limited)
        flavors[name] = args
    return name


def model_config_with_groups(model: Any, groups: Optional[int], limited: Optional[int]) -> Any:
    """A copy of a torchtitan 0.3.0 model config whose every router has node-limited routing
    ``groups`` / ``limited``."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    model = copy.deepcopy(model)
    for _fqn, router, _parent, _attr in list(model.traverse(TokenChoiceTopKRouter.Config)):
        router.num_expert_groups, router.num_limited_groups = groups, limited
    return model
