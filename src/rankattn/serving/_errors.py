"""The serving module's error codes (RA2xx), registered into :mod:`rankattn.errors`."""

from __future__ import annotations

from rankattn.errors import ErrorKind, RankattnRuntimeError, RankattnTypeError, register

register(
    ErrorKind(
        "RA201", "cache is not a PagedKVCache or its arrays disagree",
        "Serving functions take the cache built by rankattn.serving.empty_cache or "
        "cache_from_history (and returned by append / release): a PagedKVCache whose k_pages "
        "[N, Hkv, P, D] and v_pages [N, Hkv, P, Dv] agree on N, Hkv and P, with key min/max "
        "[N, Hkv, D], page_table [U, max_pages] and lengths [U]. stack_caches takes a list of "
        "such caches, one per layer, all of the same shapes and dtypes.",
        "Pass the cache object that the last append or release returned; do not rebuild its "
        "fields by hand. To stack layers, build every layer's cache with the same arguments.",
        RankattnTypeError),
    ErrorKind(
        "RA202", "unsupported query shape",
        "attend takes queries as [B, T, Hq, D] (T candidates or decode steps per row), "
        "[B, Hq, D] (one query per row) or [B, Hq*D] (heads flattened, as SGLang passes them); "
        "the output has the same layout with D replaced by the value head dim.",
        "Reshape the query to one of the three layouts; B is the number of cached users you "
        "score (the length of users).",
        RankattnTypeError),
    ErrorKind(
        "RA203", "flattened query size is not a multiple of the head dim",
        "A 2-D query [B, Hq*D] is split into heads of the cache's head dim D, so its last axis "
        "must be a multiple of D.",
        "Check that the query comes from the same layer as the cache (same head dim), or pass it "
        "as [B, Hq, D]."),
    ErrorKind(
        "RA204", "query heads are not a multiple of the cache's kv heads",
        "Grouped-query attention gives query head h the kv head h // (Hq // Hkv), so Hq must be "
        "divisible by the cache's Hkv. Any divisible ratio works, in every gqa mode.",
        "Use a cache built with a kv head count that divides the query head count (the message "
        "lists them), or pass the query heads of this layer only."),
    ErrorKind(
        "RA205", "query and cache disagree on the head dim",
        "q . k needs the query head dim to equal the cached keys' head dim.",
        "Pass the query of the layer whose K/V the cache holds."),
    ErrorKind(
        "RA206", "users has the wrong shape, dtype or values",
        "users is an integer array [B]: row b of the query is scored against cached user "
        "users[b], which must be in [0, U). (Only concrete users can be range-checked; under jit "
        "an out-of-range id reads a clamped row.)",
        "Pass jnp.asarray(ids, jnp.int32) with one id per query row, each below the cache's "
        "user count."),
    ErrorKind(
        "RA207", "self_kv is malformed",
        "self_kv is a pair (k_self, v_self) holding each query's own key and value: "
        "[B, T, Hkv, D] and [B, T, Hkv, Dv] for 4-D queries, [B, Hkv, D] / [B, Hkv, Dv] for "
        "3-D queries, [B, Hkv*D] / [B, Hkv*Dv] for 2-D queries.",
        "Pass a tuple of two arrays in the query's layout with the cache's kv heads and head "
        "dims, or self_kv=None when the queries have no self term."),
    ErrorKind(
        "RA208", "budget, sink_pages or recent_pages is invalid",
        "budget is a token count (a Python int, or None for exact attention); it buys "
        "budget // P pages per query, at least the sink_pages first and recent_pages last pages "
        "that are always kept (exactly those is a StreamingLLM window), and at least one. "
        "sink_pages and recent_pages are non-negative Python ints.",
        "Pass budget=None for the exact path, or a budget of at least "
        "max(sink_pages + recent_pages, 1) * P tokens."),
    ErrorKind(
        "RA209", "unknown gqa mode, selection or group rule",
        "gqa is 'per_head' (each query head picks its pages), 'group' (one page set per kv "
        "head, the default) or 'mean' (the group's mean query is scored, as SGLang does). "
        "selection is 'per_query' (each candidate picks its pages, the default) or "
        "'per_request' (a request's candidates share them). group_rule picks how page scores "
        "are merged where queries share a page set: a kv head's query heads under 'group', a "
        "request's rows under 'per_request'.",
        "Pass one of the listed names."),
    ErrorKind(
        "RA210", "append does not fit in the cache",
        "A user's history can hold at most max_pages * P tokens, and new pages come from the "
        "cache's free pages. When the arrays are concrete, an append that does not fit raises "
        "this error and changes nothing. Under jit it cannot raise: the users whose tokens do "
        "not fit are left unchanged and cache.overflow becomes True (and stays True).",
        "Release users you no longer serve (rankattn.serving.release), or build the cache with "
        "more pages (num_pages=) or a larger per-user limit (max_pages=)."),
    ErrorKind(
        "RA211", "append arguments are malformed",
        "append takes users [B] (distinct ids), k_new [B, T, Hkv, D] and v_new [B, T, Hkv, Dv] "
        "matching the cache's heads and head dims, and counts [B] with 0 <= counts <= T "
        "(row b appends its first counts[b] tokens).",
        "Shape the new tokens like the cache's pages, give each user at most one row per call, "
        "and pass counts as an int array [B]."),
    ErrorKind(
        "RA212", "history arrays or page layout are malformed",
        "cache_from_history and sharded_cache_from_history take k_hist [U, S, Hkv, D], v_hist "
        "[U, S, Hkv, Dv] (or [L, U, S, Hkv, D] / [L, U, S, Hkv, Dv] for L stacked layers) of one "
        "float dtype and lengths [U] with 0 <= lengths <= S; empty_cache takes positive ints "
        "(page_size, num_pages, max_pages, heads, head dims, num_layers) and a float dtype.",
        "Pad the histories to one length S, pass their true lengths, and use positive ints "
        "such as page_size=16."),
    ErrorKind(
        "RA213", "a serving input has a non-float dtype",
        "Queries, keys and values must be floating point (float32, bfloat16, float16, or "
        "float64 with x64). The math runs in float32 (float64 for float64 inputs); the cache "
        "may use a different float dtype than the queries.",
        "Cast with .astype(jnp.float32) or .astype(jnp.bfloat16).",
        RankattnTypeError),
    ErrorKind(
        "RA214", "a new value does not fit the cache's dtype",
        "append (and HistoryStore.write into a float16 store) stores keys and values in the "
        "cache's dtype; a finite value beyond its range (|x| > 65504 for float16) would be "
        "stored as inf and poison every query that reads it. When the arrays are concrete this "
        "error is raised and nothing changes (a write's lease stays unwritten); under jit the "
        "user is skipped, cache.overflow is set, and append(..., return_status=True) reports "
        "it in status.out_of_range.",
        "Scale or clip the values before caching them, or build the cache with a wider dtype "
        "(dtype=jnp.float32 or jnp.bfloat16)."),
    ErrorKind(
        "RA215", "sharded serving arguments do not fit the sharding",
        "attend(..., sharding=) takes a sharded cache whose arrays lead with (batch shards, "
        "context shards) of the sharding, rows that split evenly over the batch shards, no "
        "heads= axes, and no budget when the history is split over context axes (Quest runs "
        "per user on batch shards only).",
        "Build the cache with rankattn.serving.sharded_cache_from_history(k, v, lengths, "
        "sharding=sharding) or shard_cache, pass a multiple of the batch shards' count of rows, "
        "and drop budget= or context= as the message says."),
    ErrorKind(
        "RA216", "a query row's user is cached on another shard",
        "Rows of q are split over the batch axes (row b on shard b // (B / nb)) and batch shard "
        "i caches users [i * U, (i + 1) * U); a row can only read its own shard's cache.",
        "Route each request to the rows of the shard that holds its user (user u lives on "
        "shard u // U), padding the other rows with any user of that shard."),
    ErrorKind(
        "RA217", "an option was passed positionally",
        "Serving functions take their arrays positionally and every option by keyword: "
        "attend(q, cache, users, *, self_kv=None, budget=None, ..., return_lse=False), "
        "cache_from_history(k_hist, v_hist, lengths, *, page_size=16, num_pages=None, "
        "max_pages=None) and sharded_cache_from_history(k_hist, v_hist, lengths, *, sharding, "
        "page_size=16, ...). Older spellings passed self_kv, page_size or sharding positionally; "
        "they are refused rather than read differently.",
        "Name the option, as the message writes it: attend(q, cache, users, "
        "self_kv=(k_self, v_self)), cache_from_history(k, v, lengths, page_size=16), "
        "sharded_cache_from_history(k, v, lengths, sharding=sharding).",
        RankattnTypeError),
    ErrorKind(
        "RA218", "layer= does not fit the cache",
        "A stacked cache holds L layers' caches along a leading axis (k_pages [L, N, Hkv, P, D], "
        "every array likewise), so attend, append, release, select_pages and page_bounds need "
        "layer=i to pick one: a Python int in [0, L), or an int32 scalar that may be traced "
        "(a fori_loop index; a traced layer outside [0, L) reads a clamped layer and writes "
        "nothing). A cache of one layer takes no layer=.",
        "Pass layer=i with a stacked cache, or scan over it (jax.lax.scan(body, x, cache) hands "
        "body one layer's cache, which takes no layer=); drop layer= with one layer's cache, or "
        "stack the layers' caches with stack_caches."),
    ErrorKind(
        "RA219", "HistoryStore options are invalid",
        "serving.HistoryStore(num_layers=, kv_heads=, head_dim=, page_size=, device_pages=, "
        "max_users=, max_pages_per_user=, host_pages=, history=, ...) sizes one stacked paged "
        "cache and its host tier: positive ints (host_pages may be 0), max_pages_per_user at "
        "most device_pages, history 'bidirectional' or 'causal', policy a name in "
        "serving.EVICTION_POLICIES ('lru' or 's3fifo'), a float dtype, and sizes whose "
        "indices fit int32 (the message says which empty_cache refused).",
        "Pass the sizes as Python ints, e.g. HistoryStore(num_layers=4, kv_heads=2, "
        "head_dim=64, device_pages=4096, max_users=512, max_pages_per_user=64)."),
    ErrorKind(
        "RA220", "acquire rows are malformed",
        "HistoryStore.acquire(user_ids, versions, lengths) (and unwritten(), which takes the "
        "same rows) takes one int per row in each "
        "(equal lengths, lengths >= 0). Rows of one user must share version and length: one "
        "slot holds one history of a user per call.",
        "Pass three equal-length int sequences; acquire a user's second history in a later "
        "call."),
    ErrorKind(
        "RA221", "a history is longer than a user's capacity",
        "A store holds at most max_pages_per_user * page_size tokens of one user's history; "
        "a longer history can never be cached (a server answers it as too large).",
        "Cut the history to its newest tokens, or build the store with a larger "
        "max_pages_per_user (and device_pages)."),
    ErrorKind(
        "RA222", "the store has no room for the call",
        "Every page or slot that could make room belongs to an entry pinned by a lease that "
        "has not been released (or acquire waited past its timeout for another lease's "
        "write): the condition passes as leases are released. Or the call's rows together "
        "need more slots (one per distinct user) or pages than the whole store has: that "
        "never passes, and the message says so. Nothing was changed.",
        "Retry after releasing leases (a server answers 503 with Retry-After), acquire fewer "
        "rows at once (a call larger than the store must be split), or build a store with "
        "more device_pages / max_users."),
    ErrorKind(
        "RA223", "a lease or a store method was misused",
        "A Lease is released once and written at most once, by the store that made it, with "
        "k / v [L, R, T, Hkv, D] holding the lease rows `rows` (default every row, R = B) and "
        "covering every row with tokens missing; acquire, write, release "
        "and clear are not called inside store.reading() on the same thread (the update "
        "would wait for that reader).",
        "Release each lease once (use it as a context manager), write once with the shapes "
        "the message names, and leave reading() before updating the store."),
    ErrorKind(
        "RA224", "a store copy or device update failed",
        "A HistoryStore spill (device to host memory), restore (host to device) or device "
        "update (a write, or the drop of freed pages) raised, e.g. an allocation failure "
        "(RESOURCE_EXHAUSTED); the original error is chained as the cause. The entries it was "
        "for were dropped: a failed acquire unpinned its rows and returned no lease; after a "
        "failed write the lease is still held, its unwritten rows no longer shared. The rest "
        "of the store is unaffected.",
        "Release the lease if you hold one, then acquire the rows again: they come back as "
        "misses. If it recurs, free device or host memory (a smaller store, fewer rows per "
        "call, or a smaller host_pages).",
        RankattnRuntimeError),
)
