"""The dashboard's pages, one module each: `layout(...)` builds the page the router shows, and the
page's callbacks are declared beside it at module level, on the module's `callbacks`
(`callbacks.PageCallbacks`), which the app adds to itself; sign-in has no callbacks but its form's
routes (`signin.register(app, api, prefix)`).

    runs      /dashboard/                     runs list
    run       /dashboard/runs/{run_id}        one run (its per-layer part in `run_layers`, views in
                                              `run_views`)
    compare   /dashboard/compare?runs=a,b     runs overlaid
    alerts    /dashboard/alerts               alerts, with the rules card (`alert_rules`) and the
                                              webhooks card (`webhooks`); views in `alerts_views`
    signin    /dashboard/signin               the token form
"""
