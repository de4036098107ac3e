// The search page: talks to the same /v1 API as any client. No framework, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const collections = new Map(); // name -> {embedding, dimension}
const storeNames = new Map(); // vector store id (its collection's name) -> the store's name, from /v1/vector_stores
const STORE_RE = /^vs_[0-9a-f]{24}$/; // an OpenAI vector store's collection is named by the store's id
let lastStatus = "";
let searchDefaults = null; // what a search that names no fusion gets: the defaults of the service's OpenAPI document

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("apikey").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, body) {
  const init = body === undefined
    ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const res = await fetch(path, init);
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(`${res.status}: ${data.detail || res.statusText}`);
  return data;
}

function showError(msg) {
  $("error").textContent = msg;
  $("error").hidden = !msg;
}

function bytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// -- vector stores: their collections (vs_<hex>) labelled with the store's name --------------------------------
async function loadStoreNames() {
  // Every page of the stores this key may see; a collection whose store is not among them stays "vector store".
  let after = null;
  for (;;) {
    const params = new URLSearchParams({ limit: "100", order: "asc" });
    if (after) params.set("after", after);
    const page = await api(`/v1/vector_stores?${params}`);
    for (const st of page.data) storeNames.set(st.id, st.name);
    if (!page.has_more || !page.last_id) break;
    after = page.last_id;
  }
}

function storeLabel(name) {
  const label = storeNames.get(name);
  return label ? `vector store "${label}"` : "vector store";
}

function storeBadge(name) {
  const badge = document.createElement("span");
  badge.className = "badge store";
  badge.textContent = storeLabel(name);
  badge.title = `${storeLabel(name)}: the collection of the OpenAI vector store ${name} (/v1/vector_stores)`;
  return badge;
}

async function storeNamesFor(names) {
  // Asked again only when a store's collection not yet named shows up.
  if (names.some((n) => STORE_RE.test(n) && !storeNames.has(n))) {
    await loadStoreNames().catch(() => {});
  }
}

async function loadCollections() {
  const data = await api("/v1/collections");
  await storeNamesFor(data.collections.map((c) => c.name));
  const select = $("collection");
  const keep = select.value;
  select.replaceChildren();
  collections.clear();
  for (const c of data.collections) {
    collections.set(c.name, c);
    const label = STORE_RE.test(c.name) ? `${storeLabel(c.name)} · ${c.name}` : c.name;
    select.append(new Option(`${label} (${c.count})`, c.name));
  }
  if (collections.has(keep)) select.value = keep;
  else if (collections.has("demo")) select.value = "demo";
}

function renderHits(hits, fusion) {
  const list = $("results");
  list.replaceChildren();
  for (const h of hits) {
    const li = document.createElement("li");
    li.dataset.id = h.id;
    const head = document.createElement("div");
    head.className = "hit-head";
    const id = document.createElement("span");
    id.className = "hit-id";
    id.textContent = h.id;
    const score = document.createElement("span");
    score.className = "hit-score";
    score.textContent = `score ${h.score.toFixed(4)}` + (fusion ? ` (${fusion.method === "rrf" ? "RRF" : "weighted"})` : "");
    if (fusion) score.title = "the fusion's score: see the note above the results";
    const meta = document.createElement("span");
    meta.className = "hit-meta";
    meta.textContent = Object.entries(h.metadata || {}).map(([k, v]) => `${k}: ${v}`).join(" · ");
    head.append(id, score, meta);
    const text = document.createElement("div");
    text.className = "hit-text";
    text.textContent = h.text || "";
    li.append(head, text);
    li.addEventListener("click", () => openDocument(h.id));
    list.append(li);
  }
}

// -- the document browser: a page of the documents a filter passes, and one document opened ---------------
let browsing = null; // {name, filter, cursor}: what "More" goes on with

function collectionPath(name) {
  return `/v1/collections/${encodeURIComponent(name)}`;
}

async function browse(event) {
  event.preventDefault();
  showError("");
  const name = $("collection").value;
  if (!name) return showError("no collection to browse");
  const text = $("filter").value.trim();
  let filter = null;
  if (text) {
    try { filter = JSON.parse(text); } catch (e) { return showError(`the filter is not JSON: ${e.message}`); }
  }
  browsing = { name, filter, cursor: null };
  $("documents").replaceChildren();
  $("document").hidden = true;
  try {
    const counted = await api(`${collectionPath(name)}/documents/count`, filter ? { filter } : {});
    const warn = (counted.warnings || []).join("; ");
    $("browse-summary").textContent = `${counted.count} documents${filter ? " pass the filter" : ""}` +
      (warn ? ` · ${warn}` : "");
    await morePage();
  } catch (e) {
    $("browse-summary").textContent = "";
    showError(e.message);
  }
}

async function morePage() {
  const b = browsing;
  const params = new URLSearchParams(); // a page of the service's default size
  if (b.filter) params.set("filter", JSON.stringify(b.filter));
  if (b.cursor !== null) params.set("cursor", String(b.cursor));
  const data = await api(`${collectionPath(b.name)}/documents?${params}`);
  const list = $("documents");
  for (const d of data.documents) {
    const li = document.createElement("li");
    li.dataset.id = d.id;
    const id = document.createElement("span");
    id.className = "hit-id";
    id.textContent = d.id;
    const text = document.createElement("span");
    text.className = "doc-snippet";
    text.textContent = (d.text || "").slice(0, 120);
    li.append(id, text);
    li.addEventListener("click", () => openDocument(d.id));
    list.append(li);
  }
  b.cursor = data.next_cursor;
  $("more").hidden = data.next_cursor === null || data.next_cursor === undefined;
}

async function openDocument(id) {
  showError("");
  const name = $("collection").value;
  try {
    const d = await api(`${collectionPath(name)}/documents/${encodeURIComponent(id)}`);
    $("doc-id").textContent = d.id;
    $("doc-meta").textContent = JSON.stringify(d.metadata || {}, null, 2);
    $("doc-text").textContent = d.text || "";
    $("document").hidden = false;
    $("document").scrollIntoView({ block: "nearest" });
  } catch (e) {
    showError(e.message);
  }
}

// -- hybrid scores, explained: the fusion a search gets when it names none, from the service's own OpenAPI document
async function fusionDefaults() {
  if (!searchDefaults) {
    const doc = await fetch("/openapi.json").then((r) => r.json());
    const schemas = doc.components.schemas;
    const f = schemas.FusionSpec.properties;
    searchDefaults = { method: f.method.default, k: f.k.default, share: f.question_share.default,
                       w: schemas.SearchRequest.properties.text_weight.default };
  }
  return searchDefaults;
}

function fusionNote(d) {
  const q = d.share < 1
    ? ` (${+(d.w * d.share).toFixed(4)} for a query phrased as a question, whose text ranking leaves out words such as "how" and "do")`
    : "";
  const head = "Hybrid scores are the fusion's, not similarities: ";
  if (d.method === "rrf") {
    return head + `reciprocal rank fusion (RRF, k = ${d.k}) of the vector ranking and the text (BM25) ranking. ` +
      `A document scores (1 − w) / (${d.k} + its vector rank) + w / (${d.k} + its text rank), text weight ` +
      `w = ${d.w}${q}; a ranking it is not in adds nothing. Higher is better: first in both scores ` +
      `1 / ${d.k + 1} = ${(1 / (d.k + 1)).toFixed(4)}.`;
  }
  return head + `weighted fusion of the vector ranking and the text (BM25) ranking, each ranking's scores ` +
    `min-max normalised to [0, 1] over the query's own ranking, then (1 − w) × vector + w × text, text weight ` +
    `w = ${d.w}${q}. Higher is better, at most 1.`;
}

function searchFilter() {
  // The search box's filter, as the API takes it ({"field": value, "field": {"$op": value}, "$and": [...]}), or
  // null; a string saying what is wrong with it.
  const text = $("search-filter").value.trim();
  if (!text) return { filter: null };
  let filter;
  try { filter = JSON.parse(text); } catch (e) { return { error: `the search filter is not JSON: ${e.message}` }; }
  if (filter === null || typeof filter !== "object" || Array.isArray(filter)) {
    return { error: 'the search filter must be a JSON object, e.g. {"source": "concepts.md"}' };
  }
  return { filter };
}

async function search(event) {
  event.preventDefault();
  showError("");
  const name = $("collection").value;
  const query = $("query").value.trim();
  if (!name) return showError("no collection to search");
  if (!query) return showError("type something to search for");
  const mode = $("mode").value;
  if (mode !== "text" && !(collections.get(name) || {}).embedding) {
    return showError(`collection ${name} has no embedding model: search it in text mode, or with vectors through the API`);
  }
  const { filter, error } = searchFilter();
  if (error) return showError(error);
  const k = parseInt($("k").value, 10) || 5;
  const t0 = performance.now();
  $("fusion-note").hidden = true;
  try {
    const body = { texts: [query], k, mode, stats: true };
    if (filter) body.filter = filter;
    const data = await api(`/v1/collections/${encodeURIComponent(name)}/search`, body);
    const st = data.stats[0];
    let fusion = null;
    if (mode === "hybrid") {
      fusion = await fusionDefaults().catch(() => null);
      $("fusion-note").textContent = fusion ? fusionNote(fusion)
        : "Hybrid scores are the fusion's (the vector and the text rankings fused), not similarities: see /docs.";
      $("fusion-note").hidden = false;
    }
    renderHits(data.results[0], fusion);
    const parts = [];
    if (mode !== "text") {
      parts.push(`${st.pages_read} pages read, ${st.pages_buffered} from the buffer, ${st.lists_probed} lists probed`);
    }
    if (mode !== "vector") parts.push(`${st.text_candidates} matched by words`);
    if (filter) parts.push("filtered");
    const warn = (data.warnings || []).join("; ");
    $("summary").textContent =
      `${data.results[0].length} hits in ${(performance.now() - t0).toFixed(1)} ms · ` + parts.join(" · ") +
      (warn ? ` · ${warn}` : "");
  } catch (e) {
    renderHits([]);
    $("summary").textContent = "";
    showError(e.message);
  }
  refreshFigures();
}

function buildState(b) {
  // What a collection is doing: an import or a merge with its step, or how its last import ended.
  const imp = b.import || {};
  const p = b.progress;
  if (p) {
    const pct = p.total ? ` ${Math.floor((100 * p.done) / p.total)}%` : "";
    return `${imp.state === "running" ? "importing" : "merging"}: ${p.step}${pct}`;
  }
  if (imp.state === "running") return "importing";
  if (imp.state === "failed") return `import failed: ${imp.reason}`;
  return b.merging ? "merging" : "ready";
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = "badge " + cls;
}

async function refreshFigures() {
  try {
    const ready = await fetch("/readyz").then((r) => r.json());
    setStatus(ready.status, ready.status);
    const data = await api("/v1/stats");
    const r = data.recent;
    const rows = [
      ["searches (recent)", r.searches],
      ["latency p50", r.latency_ms_p50 !== undefined ? `${r.latency_ms_p50} ms` : "–"],
      ["latency p95", r.latency_ms_p95 !== undefined ? `${r.latency_ms_p95} ms` : "–"],
      ["pages read per query", r.pages_read_per_query ?? "–"],
      ["page buffer hit ratio", r.page_buffer_hit_ratio ?? "–"],
    ];
    const dl = $("recent");
    dl.replaceChildren();
    for (const [k, v] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = k;
      const dd = document.createElement("dd");
      dd.textContent = v;
      dd.dataset.figure = k;
      dl.append(dt, dd);
    }
    await storeNamesFor(Object.keys(data.collections));
    const body = $("tiers").tBodies[0];
    body.replaceChildren();
    for (const [name, info] of Object.entries(data.collections)) {
      const t = info.tiers || {};
      const tr = body.insertRow();
      tr.dataset.collection = name;
      const pq = bytes(t.pq_bytes) + (t.pq_tier ? ` (${t.pq_tier})` : "");
      // The buffer's bytes: blocks (page_buffer_bytes) and single records (record_cache_bytes) share it, or the
      // raw vectors held in RAM in its place (raw_vectors_bytes: raw_in_ram, where the budget holds them).
      const buffer = (t.page_buffer_bytes || 0) + (t.record_cache_bytes || 0) + (t.raw_vectors_bytes || 0);
      const cells = [name, info.count, bytes(t.host_index_bytes), pq, bytes(buffer), bytes(t.ssd_bytes),
        bytes(t.fresh_bytes), buildState(info.build_state || {})];
      for (const v of cells) {
        tr.insertCell().textContent = v;
      }
      tr.cells[tr.cells.length - 1].className = "state";
      if (STORE_RE.test(name)) tr.cells[0].append(" ", storeBadge(name));
    }
    if (ready.status === "ready" && lastStatus !== "ready") await loadCollections();
    lastStatus = ready.status;
  } catch (e) {
    setStatus(e.message.startsWith("401") || e.message.startsWith("403") ? "API key needed" : "offline", "failed");
  }
}

$("apikey").value = localStorage.getItem("fusionrag-key") || "";
$("apikey").addEventListener("change", () => {
  localStorage.setItem("fusionrag-key", $("apikey").value.trim());
  loadCollections().then(() => showError(""), (e) => showError(e.message));
  refreshFigures();
});
$("search-form").addEventListener("submit", search);
$("browse-form").addEventListener("submit", browse);
$("more").addEventListener("click", () => morePage().catch((e) => showError(e.message)));
loadCollections().catch((e) => showError(e.message));
refreshFigures();
setInterval(refreshFigures, 2000);
