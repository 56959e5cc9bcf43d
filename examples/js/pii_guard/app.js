// A chat filter in JavaScript: rewrites e-mail addresses and phone numbers
// in the user's messages before the model sees them, and counts what it
// replaced in the response metadata.
//
// Configuration (optional): {"email": "[EMAIL]", "phone": "[PHONE]"}
import { Filter, exportFilter, log, next } from './shallot.js';

const EMAIL = /[\w.+-]+@[\w-]+(\.[\w-]+)+/g;
const PHONE = /\+?\d[\d ()-]{7,}\d/g;

class PiiGuard extends Filter {
  static filterName = 'pii-guard-js';

  constructor(config) {
    super(config);
    const c = config ?? {};
    const unknown = Object.keys(c).filter((k) => !['email', 'phone'].includes(k));
    if (unknown.length) throw new Error(`unknown option(s): ${unknown.join(', ')}`);
    this.email = c.email ?? '[EMAIL]';
    this.phone = c.phone ?? '[PHONE]';
  }

  aroundChat(request, fctx) {
    let replaced = 0;
    const count = (replacement) => () => {
      replaced += 1;
      return replacement;
    };
    const messages = request.messages();
    for (const message of messages) {
      if (message.role === 'user' && message.content?.tag === 'text') {
        const text = message.content.val.replace(EMAIL, count(this.email)).replace(PHONE, count(this.phone));
        message.content = { tag: 'text', val: text };
      }
    }
    if (replaced) {
      request.setMessages(messages);
      log.info(`replaced ${replaced} piece(s) of personal data`);
    }
    const response = next.chat(request);
    const metadata = JSON.parse(response.metadata());
    metadata.pii_replaced = replaced;
    response.setMetadata(JSON.stringify(metadata));
    return response;
  }
}

exportFilter(PiiGuard);
export * from './shallot.js';
