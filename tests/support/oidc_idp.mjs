// A real OpenID Provider for the tests: oauth2-mock-server (pinned in .ci/test-peers) on
// 127.0.0.1, configured for agentry:
// - discovery, JWKS, /authorize (redirects straight back with a code; PKCE and nonce are
//   honoured) and /token (client_credentials and authorization_code grants);
// - user tokens carry sub, email, name, groups (and email_verified when the test sets
//   it) from the JSON file IDP_USER, read at
//   each issuance, so a test changes a user's groups by rewriting it;
// - access tokens are for the audience IDP_AUDIENCE; ID tokens for the client.
// Test controls, under /_test/ (nothing else of the server is changed by them):
// - POST /_test/rotate {kid?, alg?}: a new signing key for `alg` (RS256 unless given:
//   PS256, ES256, ES384, EdDSA, ...) replaces the whole key set; the JWKS publishes it
//   with that `alg`, and the token endpoint signs with it from then on;
// - POST /_test/sign {header?, claims, key?, alg?}: signs exactly these claims — with the
//   current key (key "current"; with `alg`, that algorithm on the same key material
//   instead of the key's own), with a fresh key that is not published ("foreign"), or
//   HS256 with the current public key's PEM as the HMAC secret ("hs256-public-pem").
// Env: IDP_MODULES (node_modules holding the package), IDP_PORT (0: any), IDP_KID (the
// first key's kid), IDP_USER, IDP_AUDIENCE. Prints one JSON line {"port", "issuer"} when
// it listens.
import http from 'node:http';
import { createHmac, createPublicKey, randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const modules = process.env.IDP_MODULES;
const load = (p) => import(pathToFileURL(join(modules, p)).href);
const { OAuth2Issuer, OAuth2Service } = await load('oauth2-mock-server/dist/index.mjs');
const jose = await load('jose/dist/webapi/index.js');

const audience = process.env.IDP_AUDIENCE || 'agentry';
const userFile = process.env.IDP_USER;
let issuerUrl;
let service;

function user() {
  return JSON.parse(readFileSync(userFile, 'utf8'));
}

async function build(kid, alg) {
  const issuer = new OAuth2Issuer();
  issuer.url = issuerUrl;
  await issuer.keys.generate(alg || 'RS256', { kid: kid || randomUUID() });
  const svc = new OAuth2Service(issuer);
  svc.on('beforeTokenSigning', (token, req) => {
    const body = req.body || {};
    const p = token.payload;
    if (body.grant_type === 'client_credentials') {
      const auth = req.headers.authorization || '';
      let client = body.client_id;
      if (auth.startsWith('Basic ')) {
        client = Buffer.from(auth.slice(6), 'base64').toString().split(':')[0];
      }
      p.sub = String(client);
      p.aud = body.aud || audience;
      return;
    }
    const u = user();
    Object.assign(p, { sub: u.sub, email: u.email, name: u.name, groups: u.groups });
    if ('email_verified' in u) p.email_verified = u.email_verified;
    // The access token has a scope; the ID token keeps the client as its audience.
    if ('scope' in p) p.aud = audience;
  });
  return svc;
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    let data = '';
    req.on('data', (c) => { data += c; });
    req.on('end', () => resolve(data ? JSON.parse(data) : {}));
    req.on('error', reject);
  });
}

async function sign(body) {
  const key = service.issuer.keys.get();
  const header = { typ: 'JWT', ...(body.header || {}) };
  const claims = body.claims || {};
  switch (body.key || 'current') {
    case 'current': {
      const alg = body.alg || key.alg;
      const { alg: _pinned, ...material } = key;
      const priv = await jose.importJWK(material, alg);
      return new jose.SignJWT(claims)
        .setProtectedHeader({ alg, kid: key.kid, ...header })
        .sign(priv);
    }
    case 'foreign': {
      const { privateKey } = await jose.generateKeyPair('RS256', { extractable: true });
      return new jose.SignJWT(claims)
        .setProtectedHeader({ alg: 'RS256', kid: body.kid || randomUUID(), ...header })
        .sign(privateKey);
    }
    case 'hs256-public-pem': {
      const pub = { ...key };
      for (const f of ['d', 'p', 'q', 'dp', 'dq', 'qi']) delete pub[f];
      const pem = createPublicKey({ key: pub, format: 'jwk' }).export({ type: 'spki', format: 'pem' });
      const enc = (o) => Buffer.from(JSON.stringify(o)).toString('base64url');
      const input = `${enc({ alg: 'HS256', kid: key.kid, ...header })}.${enc(claims)}`;
      const mac = createHmac('sha256', pem).update(input).digest('base64url');
      return `${input}.${mac}`;
    }
    default:
      throw new Error(`unknown key ${body.key}`);
  }
}

async function control(req, res) {
  try {
    const body = await readBody(req);
    let answer;
    if (req.url === '/_test/rotate') {
      service = await build(body.kid, body.alg);
      answer = { kid: service.issuer.keys.get().kid };
    } else if (req.url === '/_test/sign') {
      answer = { token: await sign(body) };
    } else {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(answer));
  } catch (e) {
    res.writeHead(500, { 'content-type': 'text/plain' }).end(String(e && e.stack));
  }
}

const server = http.createServer((req, res) => {
  if (!service) return res.writeHead(503).end();
  if (req.url.startsWith('/_test/')) return control(req, res);
  return service.requestHandler(req, res);
});
server.listen(Number(process.env.IDP_PORT || 0), '127.0.0.1', async () => {
  const { port } = server.address();
  issuerUrl = `http://127.0.0.1:${port}`;
  service = await build(process.env.IDP_KID);
  process.stdout.write(`${JSON.stringify({ port, issuer: issuerUrl })}\n`);
});
process.on('SIGTERM', () => process.exit(0));
