package server_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/server"
	"stasis/internal/stasistest"
)

// request sends one request to base+path with the given headers and
// returns the status and the body; a transport error fails the test.
func request(t *testing.T, hc *http.Client, method, url, body string, hdr map[string]string) (int, string) {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// errType is the "type" of an API error body ("" if it is not one).
func errType(body string) string {
	var e apiErr
	_ = json.Unmarshal([]byte(body), &e)
	return e.Error.Type
}

// checkpointsIn lists the checkpoints a server at base holds.
func checkpointsIn(t *testing.T, hc *http.Client, base string, hdr map[string]string) int {
	t.Helper()
	code, b := request(t, hc, "GET", base+"/v1/checkpoints", "", hdr)
	if code != 200 {
		t.Fatalf("GET /v1/checkpoints: %d %s", code, b)
	}
	var l struct {
		Checkpoints []json.RawMessage `json:"checkpoints"`
	}
	if err := json.Unmarshal([]byte(b), &l); err != nil {
		var arr []json.RawMessage
		if err := json.Unmarshal([]byte(b), &arr); err != nil {
			t.Fatalf("GET /v1/checkpoints: %v: %s", err, b)
		}
		return len(arr)
	}
	return len(l.Checkpoints)
}

// A loopback server without credentials, as a web page in the operator's
// browser would attack it: a cross-site text/plain POST (a "simple"
// request, sent without a preflight), a JSON one carrying the browser's
// cross-site headers, and a DNS-rebinding page whose Host is its own name.
// Each is refused and no checkpoint is made; the server's own client
// still works.
func TestLoopbackAPIRefusesBrowsers(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	cleanState(t, state)
	r := startServer(t, ctx, state, nil)
	defer r.Close()
	base, hc := r.ts.URL, r.ts.Client()

	for _, c := range []struct {
		name, body string
		hdr        map[string]string
		code       int
		typ        string
	}{
		{"cross-site text/plain post", `{"id":"ckpt-evil"}`, map[string]string{"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403, "forbidden"},
		{"text/plain post", `{"id":"ckpt-evil"}`, map[string]string{"Content-Type": "text/plain"}, 415, "unsupported_media_type"},
		{"form post", `id=ckpt-evil`, map[string]string{"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"},
		{"no content type", `{"id":"ckpt-evil"}`, map[string]string{}, 415, "unsupported_media_type"},
		{"cross-site JSON", `{"id":"ckpt-evil"}`, map[string]string{"Content-Type": "application/json", "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, 403, "forbidden"},
		{"cross-origin JSON without Sec-Fetch-Site", `{"id":"ckpt-evil"}`, map[string]string{"Content-Type": "application/json", "Origin": "http://evil.example"}, 403, "forbidden"},
		{"rebound Host", `{"id":"ckpt-evil"}`, map[string]string{"Content-Type": "application/json", "Host": "evil.example"}, 421, "misdirected"},
		{"rebound Host with port", `{"id":"ckpt-evil"}`, map[string]string{"Content-Type": "application/json", "Host": "evil.example:" + portOf(t, base)}, 421, "misdirected"},
	} {
		code, b := request(t, hc, "POST", base+"/v1/checkpoints", c.body, c.hdr)
		if code != c.code || errType(b) != c.typ {
			t.Errorf("%s: %d %s; want %d %s", c.name, code, b, c.code, c.typ)
		}
	}
	if n := checkpointsIn(t, hc, base, nil); n != 0 {
		t.Errorf("a refused request made %d checkpoints", n)
	}
	// The positive control: the same request as a client sends it is taken.
	code, b := request(t, hc, "POST", base+"/v1/checkpoints", `{"id":"ckpt-ok"}`, map[string]string{"Content-Type": "application/json"})
	if code != 201 {
		t.Fatalf("a checkpoint from the server's own client: %d %s", code, b)
	}
	for _, host := range []string{"localhost", "localhost:1234", "127.0.0.1", "[::1]:80"} {
		if code, b := request(t, hc, "GET", base+"/v1/checkpoints", "", map[string]string{"Host": host}); code != 200 {
			t.Errorf("Host %s: %d %s", host, code, b)
		}
	}
	// The gateway is not on the API: a stolen relay token is of no use here.
	for _, p := range []string{"/gateway/v1/models", "/gateway/v1/chat/completions", "/gateway/metrics"} {
		method := "GET"
		if strings.HasSuffix(p, "completions") {
			method = "POST"
		}
		if code, b := request(t, hc, method, base+p, `{}`, map[string]string{"Content-Type": "application/json", "Authorization": "Bearer x"}); code != 404 {
			t.Errorf("%s %s on the API: %d %s", method, p, code, b)
		}
	}
	// Its metrics are the server's.
	if code, b := request(t, hc, "GET", base+"/metrics", "", nil); code != 200 || !strings.Contains(b, "stasis_gateway_") || !strings.Contains(b, `stasis_server_requests_total{code="421",route="refused"}`) {
		t.Errorf("/metrics: %d, lacks the gateway's metrics or the refusals:\n%s", code, b)
	}
}

func portOf(t *testing.T, base string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(strings.TrimPrefix(strings.TrimPrefix(base, "http://"), "https://"))
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// A server on every interface: refused without credentials (exit 2,
// naming the flag to add); with a token file, every request but /healthz
// needs one of its tokens, and neither a right nor a wrong token reaches
// the server's log.
func TestNetworkAPINeedsTokens(t *testing.T) {
	state := t.TempDir()
	cleanState(t, state)
	_, errOut, code := stasistest.Run(t, nil, "", "serve", "--listen", "0.0.0.0:0", "--state", state)
	if code != 2 || !strings.Contains(errOut, "--api-token-file") || !strings.Contains(errOut, "open to the network") {
		t.Fatalf("serve --listen 0.0.0.0:0 without credentials: exit %d: %s", code, errOut)
	}
	dir := t.TempDir()
	const good, other = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
	bad := filepath.Join(dir, "short")
	if err := os.WriteFile(bad, []byte("# tokens\nhunter2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, errOut, code = stasistest.Run(t, nil, "", "serve", "--listen", "0.0.0.0:0", "--state", state, "--api-token-file", bad)
	if code != 2 || !strings.Contains(errOut, "line 2") || strings.Contains(errOut, "hunter2") {
		t.Fatalf("serve with a short token: exit %d: %s", code, errOut)
	}
	toks := filepath.Join(dir, "tokens")
	if err := os.WriteFile(toks, []byte("# the trainers\n\n"+other+"\n"+good+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startServe(t, state, "--listen", "0.0.0.0:0", "--api-token-file", toks, "--log-format", "json", "--log-level", "debug")
	base := "http://127.0.0.1:" + portOf(t, "http://"+p.Addr)
	hc := &http.Client{Timeout: time.Minute}
	auth := map[string]string{"Authorization": "Bearer " + good}
	wrong := "0123456789abcdef0123456789abcdeX"
	for _, c := range []struct {
		name string
		hdr  map[string]string
		code int
	}{
		{"no token", nil, 401},
		{"a wrong token", map[string]string{"Authorization": "Bearer " + wrong}, 401},
		{"a prefix of the token", map[string]string{"Authorization": "Bearer " + good[:20]}, 401},
		{"basic auth", map[string]string{"Authorization": "Basic " + good}, 401},
		{"the token", auth, 200},
		{"the other token", map[string]string{"Authorization": "bearer " + other}, 200},
	} {
		code, b := request(t, hc, "GET", base+"/v1/episodes", "", c.hdr)
		if code != c.code {
			t.Errorf("GET /v1/episodes with %s: %d %s; want %d", c.name, code, b, c.code)
		}
		if code == 401 && errType(b) != "unauthorized" {
			t.Errorf("%s: %s", c.name, b)
		}
	}
	// Without a token nothing changes: no episode, no checkpoint.
	for _, op := range []struct{ path, body string }{
		{"/v1/episodes", `{"id":"ep-x","task":"py-ini-value-with-equals","harness":"mini"}`},
		{"/v1/checkpoints", `{"id":"ckpt-x"}`},
	} {
		if code, b := request(t, hc, "POST", base+op.path, op.body, map[string]string{"Content-Type": "application/json", "Authorization": "Bearer " + wrong}); code != 401 {
			t.Errorf("POST %s with a wrong token: %d %s", op.path, code, b)
		}
	}
	if n := checkpointsIn(t, hc, base, auth); n != 0 {
		t.Errorf("%d checkpoints made without a token", n)
	}
	if code, b := request(t, hc, "GET", base+"/v1/episodes", "", auth); code != 200 || strings.Contains(b, "ep-x") {
		t.Errorf("an episode started without a token: %d %s", code, b)
	}
	// Liveness answers without credentials; metrics do not.
	if code, b := request(t, hc, "GET", base+"/healthz", "", nil); code != 200 {
		t.Errorf("/healthz without a token: %d %s", code, b)
	}
	if code, _ := request(t, hc, "GET", base+"/metrics", "", nil); code != 401 {
		t.Errorf("/metrics without a token: %d", code)
	}
	// A name the server does not answer to.
	if code, b := request(t, hc, "GET", base+"/v1/episodes", "", map[string]string{"Authorization": "Bearer " + good, "Host": "evil.example"}); code != 421 {
		t.Errorf("Host evil.example: %d %s", code, b)
	}
	p.stop()
	log, err := os.ReadFile(p.Log)
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{good, other, wrong, good[:20]} {
		if bytes.Contains(log, []byte(tok)) {
			t.Errorf("the server's log holds a token %q", tok)
		}
	}
	if !bytes.Contains(log, []byte(`"authenticates":true`)) {
		t.Errorf("the server's log does not say it authenticates:\n%s", log)
	}
}

// TLS with client certificates, for node-to-node traffic: a client with a
// certificate the CA signed is served; one without, or with a
// certificate of another CA, is turned away at the handshake.
func TestAPIClientCertificates(t *testing.T) {
	state := t.TempDir()
	cleanState(t, state)
	dir := t.TempDir()
	ca, caKey := newCA(t, "stasis nodes")
	otherCA, otherKey := newCA(t, "someone else")
	writePEM(t, filepath.Join(dir, "ca.pem"), "CERTIFICATE", ca.Raw)
	srvCert := issue(t, ca, caKey, "stasis-1", true, filepath.Join(dir, "node"))
	_ = srvCert
	good := issue(t, ca, caKey, "trainer", false, filepath.Join(dir, "client"))
	stranger := issue(t, otherCA, otherKey, "trainer", false, filepath.Join(dir, "stranger"))

	p := startServe(t, state, "--listen", "0.0.0.0:0", "--tls-cert", filepath.Join(dir, "node.pem"), "--tls-key", filepath.Join(dir, "node-key.pem"), "--tls-client-ca", filepath.Join(dir, "ca.pem"))
	url := "https://127.0.0.1:" + portOf(t, "http://"+p.Addr) + "/v1/episodes"
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	client := func(certs ...tls.Certificate) *http.Client {
		return &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: certs}}}
	}
	if code, b := request(t, client(good), "GET", url, "", nil); code != 200 {
		t.Errorf("a client with a certificate of the CA: %d %s", code, b)
	}
	for name, hc := range map[string]*http.Client{"no certificate": client(), "another CA's certificate": client(stranger)} {
		req, _ := http.NewRequest("GET", url, nil)
		resp, err := hc.Do(req)
		if err == nil {
			resp.Body.Close()
			t.Errorf("a client with %s was served: %d", name, resp.StatusCode)
		}
	}
	// Plain HTTP to the TLS port is not served either.
	if resp, err := (&http.Client{Timeout: time.Minute}).Get(strings.Replace(url, "https:", "http:", 1)); err == nil {
		if resp.StatusCode < 400 {
			t.Errorf("plain HTTP to the TLS listener: %d", resp.StatusCode)
		}
		resp.Body.Close()
	}
	p.stop()
}

func newCA(t *testing.T, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c, key
}

// issue signs a leaf certificate (a server's for 127.0.0.1, or a
// client's), writes it and its key to base.pem and base-key.pem, and
// returns it as a tls.Certificate.
func issue(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, name string, server bool, base string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, base+".pem", "CERTIFICATE", der)
	writePEM(t, base+"-key.pem", "EC PRIVATE KEY", kder)
	c, err := tls.X509KeyPair(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// NewAccess's refusals, without a server: each names what to fix.
func TestNewAccessRefusals(t *testing.T) {
	dir := t.TempDir()
	lan := &net.TCPAddr{IP: net.ParseIP("10.1.2.3"), Port: 8080}
	for _, c := range []struct {
		name string
		addr net.Addr
		o    server.AccessOptions
		says string
	}{
		{"LAN address, no credentials", lan, server.AccessOptions{}, "--api-token-file"},
		{"IPv6 any, no credentials", &net.TCPAddr{IP: net.IPv6unspecified, Port: 1}, server.AccessOptions{}, "open to the network"},
		{"missing token file", lan, server.AccessOptions{TokenFile: filepath.Join(dir, "nope")}, "--api-token-file"},
		{"cert without key", lan, server.AccessOptions{TLSCert: filepath.Join(dir, "c.pem")}, "--tls-key"},
		{"bad host", lan, server.AccessOptions{Hosts: []string{"http://x/"}}, "--api-host"},
	} {
		if _, err := server.NewAccess(c.addr, c.o); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v; want an error saying %q", c.name, err, c.says)
		}
	}
	for _, addr := range []net.Addr{&net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 1}, &net.TCPAddr{IP: net.IPv6loopback, Port: 1}, &net.UnixAddr{Name: "/x", Net: "unix"}} {
		a, err := server.NewAccess(addr, server.AccessOptions{})
		if err != nil || a.Authenticates() {
			t.Errorf("%s without credentials: %v", addr, err)
		}
	}
	// --api-host on a LAN listener: its names and ports are the ones taken.
	toks := filepath.Join(dir, "tokens")
	if err := os.WriteFile(toks, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := server.NewAccess(lan, server.AccessOptions{TokenFile: toks, Hosts: []string{"stasis-1.internal", "10.1.2.3:8443"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(a.Guard(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(204) })))
	defer srv.Close()
	for host, want := range map[string]int{
		"stasis-1.internal": 204, "STASIS-1.internal.:9": 204, "10.1.2.3:8443": 204,
		"10.1.2.3:8080": 421, "10.1.2.3": 421, "localhost": 421, "evil.example": 421,
	} {
		code, b := request(t, srv.Client(), "GET", srv.URL+"/v1/episodes", "", map[string]string{"Host": host, "Authorization": "Bearer 0123456789abcdef0123456789abcdef"})
		if code != want {
			t.Errorf("Host %q: %d %s; want %d", host, code, b, want)
		}
	}
}
