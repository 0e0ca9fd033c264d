"""The console's pages (GET): overview, topic, message, dead letters, redrive job, parked markers.

Pages are built from the API's own handlers and models (``api.routes``) and the store's
bounded summary queries (:mod:`tracker.store.overview`): the console has no backend of its
own, so a page shows exactly what the REST API answers. Sections that change refresh on their
own (htmx polling of the same URL, swapping only the live section).

This module is the pages' one router; each area's pages are in a module of their own
(``overview_page``, ``topic_page``, ``message_pages``, ``dead_letter_pages``,
``parked_pages``), included here under ``/console`` in the order their URLs are matched.
"""

from __future__ import annotations

from fastapi import APIRouter

from . import dead_letter_pages, message_pages, overview_page, parked_pages, topic_page
from .guard import ConsoleRoute

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)
router.include_router(overview_page.router)
router.include_router(topic_page.router)
router.include_router(message_pages.router)
router.include_router(dead_letter_pages.router)
router.include_router(parked_pages.router)
