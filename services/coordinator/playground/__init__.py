"""The browser playground: a static page served at /playground, with views of the fleet and of
recent traces; its calls go through /v1 like any client's."""
