"""The web console of ``shardq serve``: the JSON API it calls (:mod:`.api`) and its page
and assets (``static/``: plain HTML, CSS and JavaScript shipped in the package, no CDN)."""
