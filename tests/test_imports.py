"""Imports point one way: no module of the server or the agent imports, however indirectly (a
function's own import included), a module that imports it; every import of the server
points down the layers that pyproject.toml's import-linter contracts declare
(``lint-imports`` prints the chains of a broken one); and the agent's package
(taskboard_agent, agent/) imports nothing of the server, Django included."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest
from importlinter import api  # noqa: F401  (configures import-linter's adapters)
from importlinter.application import use_cases
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import Contract

SERVER = ("board", "access", "escalations", "taskboard")
AGENT = "taskboard_agent"
PACKAGES = (*SERVER, AGENT)
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
CONTRACT_TYPES: dict[str, type[Contract]] = {
    "layers": LayersContract,
    "forbidden": ForbiddenContract,
}


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


def broken_contracts(graph: grimp.ImportGraph) -> list[str]:
    """Return the names of pyproject.toml's import-linter contracts that ``graph`` breaks."""
    options = use_cases.read_user_options(str(PYPROJECT))
    broken = []
    for contract_options in options.contracts_options:
        contract = CONTRACT_TYPES[contract_options["type"]](
            name=contract_options["name"],
            session_options=options.session_options,
            contract_options=contract_options,
        )
        if not contract.check(graph, verbose=False).kept:
            broken.append(contract.name)
    return broken


def contracted_graph() -> grimp.ImportGraph:
    options = use_cases.read_user_options(str(PYPROJECT))
    return grimp.build_graph(*options.session_options["root_packages"], cache_dir=None)


def test_every_import_points_down_the_layers() -> None:
    assert broken_contracts(contracted_graph()) == [], "run lint-imports for the chains"


@pytest.mark.parametrize(
    ("importer", "imported", "broken"),
    [
        # The state machine reaching for a way out: both contracts.
        ("board.transitions", "board.live.relay", 2),
        # The throttle asking live delivery, which authenticates through it.
        ("access.throttle", "board.live.relay", 1),
        # The relay reaching up to a consumer that registers with it.
        ("board.live.relay", "board.notifications.deliveries", 1),
        # The core importing the agent side.
        ("board.queues", "taskboard_agent.client", 1),
    ],
)
def test_an_import_that_climbs_breaks_a_contract(importer: str, imported: str, broken: int) -> None:
    graph = contracted_graph()
    graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="")

    assert len(broken_contracts(graph)) == broken
