// Test guest: the Rust probe's core behaviours, in JavaScript, so one onion
// can mix languages. Configuration (all optional): tag, hooks,
// short_circuit, calls, count, prefix, batch, fault, mimic, kv_count,
// fetch, metric (see tests/polyglot/py_probe/app.py, which takes the same options).
import { ChatResponse, ToolResponse } from 'shallot:filter/types@0.1.5';
import { Filter, FilterError, TokenTransform, context, exportFilter, kv, metrics, next } from './shallot.js';

const OPTIONS = ['tag', 'hooks', 'short_circuit', 'calls', 'count', 'prefix', 'batch', 'fault', 'mimic', 'kv_count', 'fetch', 'metric'];
const HOOK_NAMES = { 'around-chat': 'chat', 'around-tool': 'tool', 'around-turn': 'turn', 'token-transform': 'tokens' };

class Tokens extends TokenTransform {
  constructor(prefix, batch, fault) {
    super();
    this.prefix = prefix;
    this.batchSize = batch;
    this.fault = fault;
    this.held = [];
  }

  step(tokens, out) {
    if (this.fault) throw new Error('js-probe: fault in a token step');
    for (const { text, meta } of tokens) {
      if (this.batchSize) {
        this.held.push(text);
        if (this.held.length === this.batchSize) {
          out.push(this.prefix + this.held.join(''), meta);
          this.held = [];
        }
      } else {
        out.push(this.prefix + text, meta);
      }
    }
  }

  flush(out) {
    if (this.held.length) out.push(this.prefix + this.held.join(''));
    this.held = [];
  }
}

class Probe extends Filter {
  static filterName = 'js-probe';

  constructor(config) {
    super(config);
    const c = config ?? {};
    const unknown = Object.keys(c).filter((k) => !OPTIONS.includes(k));
    if (unknown.length) throw new Error(`unknown option(s): ${unknown.join(', ')}`);
    this.tag = c.tag ?? '';
    this.hooks = c.hooks;
    this.shortCircuit = c.short_circuit ?? false;
    this.calls = Math.max(c.calls ?? 1, 1);
    this.count = c.count ?? false;
    this.prefix = c.prefix ?? '';
    this.batch = c.batch;
    this.fault = c.fault;
    this.mimic = c.mimic ?? false;
    this.kvCount = c.kv_count;
    this.fetchUrl = c.fetch;
    this.metric = c.metric;
  }

  wants(hook) {
    return !this.hooks || this.hooks.includes(HOOK_NAMES[hook]);
  }

  push(item) {
    const trace = context.get('trace', []);
    trace.push(item);
    context.set('trace', trace);
  }

  before(fctx) {
    if (this.tag) this.push(`${this.tag}_before`);
    if (this.count) fctx.update((s) => ({ ...(s ?? {}), n: ((s ?? {}).n ?? 0) + 1 }));
  }

  after(fctx) {
    if (this.tag) {
      this.push(`${this.tag}_after`);
      if (this.count) context.set(`fctx:${this.tag}`, fctx.get());
    }
  }

  aroundChat(request, fctx) {
    if (this.fetchUrl) return this.fetchThenChat(request, fctx);
    return this.chat(request, fctx);
  }

  // Fetches `fetch` with the platform's fetch, writes `<status> <body>` to
  // context "fetched:<tag>", then goes on.
  async fetchThenChat(request, fctx) {
    const response = await fetch(this.fetchUrl);
    context.set(`fetched:${this.tag}`, `${response.status} ${await response.text()}`);
    return this.chat(request, fctx);
  }

  chat(request, fctx) {
    if (this.fault === 'chat') throw new Error('js-probe: fault in aroundChat');
    if (this.metric) metrics.count(this.metric, { lang: 'js' });
    this.before(fctx);
    if (this.kvCount) {
      const count = kv.add(this.kvCount, 1, 60000).value;
      const window = { key: `${this.kvCount}:taken`, period: { fixed: 60000 }, limit: 2, amount: 1 };
      const taken = kv.take([window]);
      const settled = kv.settle(window.key, window.period, taken.windows[0].endsMs, 0);
      context.set(`kv:${this.tag}`, {
        count,
        version: kv.get(this.kvCount).version,
        admitted: taken.admitted,
        settled,
      });
    }
    let response;
    if (this.shortCircuit) {
      const message = { role: 'assistant', content: { tag: 'text', val: `short:${this.tag}` }, toolCalls: [] };
      response = new ChatResponse(message, 'complete');
    } else {
      for (let i = 0; i < this.calls; i++) {
        try {
          response = next.chat(request);
        } catch (e) {
          if (this.mimic && e instanceof FilterError) throw new FilterError(e.kind, e.detail);
          throw e;
        }
      }
    }
    this.after(fctx);
    return response;
  }

  aroundTool(request, fctx) {
    if (this.fault === 'tool') throw new Error('js-probe: fault in aroundTool');
    this.before(fctx);
    let response;
    if (this.shortCircuit) {
      response = new ToolResponse(JSON.stringify(`short:${this.tag}`));
    } else {
      for (let i = 0; i < this.calls; i++) response = next.tool(request);
    }
    this.after(fctx);
    return response;
  }

  aroundTurn(request, fctx) {
    this.before(fctx);
    const result = next.turn(request);
    this.after(fctx);
    return result;
  }

  tokenTransform() {
    return new Tokens(this.prefix, this.batch, this.fault === 'tokens');
  }
}

exportFilter(Probe);
export * from './shallot.js';
