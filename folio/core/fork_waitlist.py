"""Siblings of an n > 1 request that wait for their parent's prompt before sharing its KV blocks.

Forking from a parent whose prompt is computed saves (n - 1) prompt prefills and (n - 1) copies of the prompt's
blocks. A sibling that cannot fork (its parent finished, or never had the same prompt) is scheduled normally
and may still hit the parent's cached full blocks.
"""

from __future__ import annotations

from folio.request import Request


class ForkWaitlist:
    """parent request id -> siblings waiting for that parent's prompt to be fully scheduled."""

    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}
        self._num_children = 0

    def __len__(self) -> int:
        return self._num_children

    @staticmethod
    def can_wait_for(parent: Request, child: Request) -> bool:
        """Only a parent that has not computed its prompt yet and has the same prompt can be forked from later."""
        return (
            parent.fork_of is None
            and not parent.is_finished()
            and parent.num_computed_tokens < parent.num_prompt_tokens
            and parent.prompt_token_ids == child.prompt_token_ids
        )

    def add(self, parent_id: str, child: Request) -> None:
        self._children.setdefault(parent_id, []).append(child)
        self._num_children += 1

    def has_children(self, parent_id: str) -> bool:
        return parent_id in self._children

    def pop_children(self, parent_id: str) -> list[Request]:
        """Remove and return the parent's waiting siblings, in arrival order (empty if none)."""
        children = self._children.pop(parent_id, [])
        self._num_children -= len(children)
        return children

    def remove(self, child: Request) -> bool:
        """Take ``child`` out (abort); returns whether it was waiting here."""
        siblings = self._children.get(child.fork_of) if child.fork_of is not None else None
        if siblings is None:
            return False
        for index, sibling in enumerate(siblings):
            if sibling is child:
                del siblings[index]
                self._num_children -= 1
                if not siblings:
                    del self._children[child.fork_of]  # type: ignore[arg-type]
                return True
        return False
