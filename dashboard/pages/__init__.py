"""The dashboard's pages, one module each: `layout(...)` builds the page the router shows,
`register(app, api, ...)` adds the page's callbacks (or, for sign-in, its form's routes) to the app.

    runs      /dashboard/                     runs list
    run       /dashboard/runs/{run_id}        one run (views in `run_views`)
    compare   /dashboard/compare?runs=a,b     runs overlaid
    alerts    /dashboard/alerts               alerts, rules, webhooks (views in `alerts_views`)
    signin    /dashboard/signin               the token form
"""
