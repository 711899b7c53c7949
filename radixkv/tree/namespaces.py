"""Namespaces: hits never cross them. A name is checked once, when it first appears."""

from __future__ import annotations

import re

from radixkv.errors import InvalidArgument, LimitExceeded
from radixkv.tree.radix_node import Node
from radixkv.tree.radix_tree import RadixTree

DEFAULT_NAMESPACE = "default"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:/@=+-]{1,128}")


def check_namespace(namespace: str, field: str = "namespace") -> None:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgument(field, "must be 1-128 characters of A-Z a-z 0-9 _ . : / @ = + -")


def namespace_root(tree: RadixTree, namespace: str, max_namespaces: int, field: str = "namespace") -> Node:
    """The root of `namespace`, created if the name is valid and the cap allows one more."""
    root = tree.roots.get(namespace)
    if root is not None:
        return root
    check_namespace(namespace, field)
    if len(tree.roots) >= max_namespaces:
        raise LimitExceeded("max_namespaces", len(tree.roots) + 1, max_namespaces)
    return tree.root(namespace)


def existing_root(tree: RadixTree, namespace: str) -> Node | None:
    """The root of `namespace` if it exists (None after checking the name): for probes that create nothing."""
    root = tree.roots.get(namespace)
    if root is None:
        check_namespace(namespace)
    return root
