"""Imports point one way: no module of the server or the agent imports, however indirectly (a
function's own import included), a module that imports it; and the agent's package
(taskboard_agent, agent/) imports nothing of the server, Django included."""

from __future__ import annotations

import grimp

SERVER = ("board", "access", "escalations", "taskboard")
AGENT = "taskboard_agent"
PACKAGES = (*SERVER, AGENT)


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


def server_modules_reached(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    """Return each module of the agent's package with a module of the server (or Django)
    that it reaches through any chain of imports."""
    server = {*SERVER, "django"}
    return sorted(
        (module, reached)
        for module in graph.modules
        if module.split(".")[0] == AGENT
        for reached in graph.find_upstream_modules(module)
        if reached.split(".")[0] in server
    )


def test_the_agent_package_imports_nothing_of_the_server() -> None:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)

    assert server_modules_reached(graph) == []


def test_an_import_of_the_server_from_the_agent_package_is_found() -> None:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)
    graph.add_import(importer="taskboard_agent.console", imported="board.models")

    assert ("taskboard_agent.cli", "board.models") in server_modules_reached(graph)
