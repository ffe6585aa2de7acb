"""Imports point one way: no module of the server imports, however indirectly (a function's
own import included), a module that imports it."""

from __future__ import annotations

import grimp

PACKAGES = ("board", "access", "escalations", "taskboard")


def import_loops(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    """Return each pair of modules where one imports the other directly and the other
    reaches back to it through any chain of imports."""
    return sorted(
        (importer, imported)
        for importer in graph.modules
        for imported in graph.find_modules_directly_imported_by(importer)
        if graph.chain_exists(importer=imported, imported=importer)
    )


def test_no_module_reaches_back_to_a_module_that_imports_it() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)

    assert import_loops(graph) == []


def test_a_loop_is_found_when_there_is_one() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    graph.add_import(importer="board.transitions", imported="board.ops.metrics")

    assert ("board.transitions", "board.ops.metrics") in import_loops(graph)
