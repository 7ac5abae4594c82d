"""KV blocks: refcounted pools per device (``block_pool``), the manager of block
tables (``block_manager``) and the default paged-cache scatter / gather
(``cache_ops``). Import from the submodules: the package itself loads nothing, so
the attention interface's ``cache_ops`` never brings the scheduler state in."""
