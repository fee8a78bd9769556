// A real OpenID Connect provider for the SSO tests (npm oidc-provider, pinned in package.json):
// authorization code with PKCE (S256 required), its own session cookie, the package's own
// login and consent pages (devInteractions: any user name, the password is not checked).
// Started by tests/sso/sites.py: node idp.mjs PORT CERT KEY ISSUER REDIRECT_URI CLIENT_SECRET
import fs from 'node:fs';
import https from 'node:https';
import Provider from 'oidc-provider';

const [port, certFile, keyFile, issuer, redirect, secret] = process.argv.slice(2);
const provider = new Provider(issuer, {
  clients: [{ client_id: 'app', client_secret: secret, redirect_uris: [redirect],
              grant_types: ['authorization_code'], response_types: ['code'],
              token_endpoint_auth_method: 'client_secret_post' }],
  pkce: { methods: ['S256'], required: () => true },
  features: { devInteractions: { enabled: true } },
  cookies: { keys: [secret] },
  findAccount: async (ctx, id) => ({ accountId: id, claims: async () => ({ sub: id }) }),
});
https.createServer({ cert: fs.readFileSync(certFile), key: fs.readFileSync(keyFile) }, provider.callback())
  .listen(Number(port), '127.0.0.1', () => console.log('ready'));
