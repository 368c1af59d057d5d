"""The one test template the whole spec runs through (see ``pytest_plugin``)."""

import pytest

from conformance.pytest_plugin import check_item, explore_item


@pytest.mark.conformance
def test_conformance(conformance_item, conformance_session, request):
    backend, case, family = conformance_item
    check_item(conformance_session, backend, case, family, request.node)


@pytest.mark.conformance_explore
def test_explore(explore_backend, conformance_session, request):
    explore_item(conformance_session, explore_backend, request.config)
