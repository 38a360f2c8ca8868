package server

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
)

// AccessOptions say who may call the API and under which names: serve's
// --api-token-file, --api-host and --tls-* flags.
type AccessOptions struct {
	// TokenFile holds the bearer tokens the API accepts, one a line
	// (blank lines and lines starting with # are ignored). With it every
	// request but GET /healthz needs "Authorization: Bearer TOKEN".
	TokenFile string
	// Hosts are names the Host header may carry besides the defaults
	// (NAME accepts any port, NAME:PORT that port only). On a non-loopback
	// listener given, they replace the default: the listen address, or for
	// an unspecified one (0.0.0.0, [::]) the machine's interface addresses,
	// its host name and the loopback names.
	Hosts []string
	// TLSCert and TLSKey serve the API over TLS; TLSClientCA (PEM, one or
	// more certificates) then requires and verifies a client certificate
	// signed by it on every connection.
	TLSCert, TLSKey, TLSClientCA string
	// Logger gets the warnings (a token file others can read, tokens over
	// plain HTTP on the network).
	Logger *slog.Logger
}

// Access guards one API listener: it checks the Host header, refuses
// cross-origin browser requests, authenticates (bearer tokens and/or
// client certificates), and carries the TLS configuration to serve with.
// Make one with NewAccess (for a listener) or LoopbackAccess.
type Access struct {
	tokens    [][sha256.Size]byte // SHA-256 of each token
	anyHost   bool                // a unix socket: any Host
	names     map[string]bool     // accepted host names, any port
	hostPorts map[string]bool     // accepted host:port pairs
	loopback  bool                // loopback names and addresses accepted
	tlsConf   *tls.Config
	mTLS      bool
}

// ErrOpenAPI is the error NewAccess answers a non-loopback listener
// without authentication with.
var ErrOpenAPI = errors.New("the API would be open to the network")

// LoopbackAccess is the guard of a loopback listener without tokens: only
// loopback names and addresses in the Host header (any port). A Server's
// Handler uses it unless Options.Access says otherwise.
func LoopbackAccess() *Access { return &Access{loopback: true} }

// NewAccess checks o against the address the API listens on and returns
// its guard. A unix socket accepts any Host; a loopback address accepts
// loopback names (localhost, 127.0.0.1, [::1], any port) and o.Hosts; any
// other address is refused (ErrOpenAPI) unless the API authenticates, by
// o.TokenFile or by client certificates (o.TLSClientCA), and then accepts
// o.Hosts or the default described at AccessOptions.Hosts. Errors name the
// flag to fix; nothing is served.
func NewAccess(addr net.Addr, o AccessOptions) (*Access, error) {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Access{}
	if o.TokenFile != "" {
		toks, err := readTokens(o.TokenFile, log)
		if err != nil {
			return nil, err
		}
		for _, t := range toks {
			a.tokens = append(a.tokens, sha256.Sum256(t))
		}
	}
	if err := a.loadTLS(o); err != nil {
		return nil, err
	}
	for _, h := range o.Hosts {
		if err := a.addHost(h); err != nil {
			return nil, err
		}
	}
	switch ad := addr.(type) {
	case *net.UnixAddr:
		a.anyHost = true
	case *net.TCPAddr:
		if ad.IP.IsLoopback() {
			a.loopback = true
			break
		}
		if len(a.tokens) == 0 && !a.mTLS {
			return nil, fmt.Errorf("--listen %s: %w: anyone who reaches it could start, retire and restore episodes and delete checkpoints. "+
				"Listen on a loopback address (127.0.0.1:PORT, [::1]:PORT) or a unix socket (unix:/path), "+
				"or authenticate callers: --api-token-file FILE (bearer tokens, one a line), and TLS (--tls-cert, --tls-key; "+
				"--tls-client-ca to require client certificates, which alone also authenticate)", ad, ErrOpenAPI)
		}
		if a.tlsConf == nil {
			log.Warn("the API listens on the network without TLS: its bearer tokens travel in clear; give --tls-cert and --tls-key", "addr", ad.String())
		}
		if len(o.Hosts) == 0 {
			if err := a.defaultHosts(ad); err != nil {
				return nil, err
			}
		}
	default:
		return nil, fmt.Errorf("the API's listener is a %T (%s): serve it on TCP or a unix socket", addr, addr)
	}
	return a, nil
}

// token68 is RFC 6750's b64token: what a bearer token may hold.
var token68 = regexp.MustCompile(`^[A-Za-z0-9._~+/-]+=*$`)

// minTokenLen is the shortest token accepted (a guessable token is no
// authentication).
const minTokenLen = 16

// readTokens reads a token file: one token a line, blank lines and
// #-comments ignored. Errors name the line, never its text.
func readTokens(path string, log *slog.Logger) ([][]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--api-token-file: %w", err)
	}
	if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o077 != 0 {
		log.Warn("the API's token file can be read by other users: chmod 600 it", "file", path, "mode", fi.Mode().Perm().String())
	}
	var toks [][]byte
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		if len(line) < minTokenLen || !token68.Match(line) {
			return nil, fmt.Errorf("--api-token-file %s: line %d is not a token: give one token a line, at least %d characters of A-Z a-z 0-9 - . _ ~ + / (e.g. from `openssl rand -hex 32`); blank lines and lines starting with # are ignored", path, n, minTokenLen)
		}
		toks = append(toks, bytes.Clone(line))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--api-token-file %s: %w", path, err)
	}
	if len(toks) == 0 {
		return nil, fmt.Errorf("--api-token-file %s: no token in it: give one token a line (blank lines and lines starting with # are ignored)", path)
	}
	return toks, nil
}

func (a *Access) loadTLS(o AccessOptions) error {
	switch {
	case o.TLSCert == "" && o.TLSKey == "" && o.TLSClientCA == "":
		return nil
	case o.TLSCert == "" || o.TLSKey == "":
		return errors.New("TLS needs both --tls-cert (the server's certificate chain, PEM) and --tls-key (its private key, PEM)")
	}
	cert, err := tls.LoadX509KeyPair(o.TLSCert, o.TLSKey)
	if err != nil {
		return fmt.Errorf("--tls-cert %s, --tls-key %s: %w", o.TLSCert, o.TLSKey, err)
	}
	a.tlsConf = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if o.TLSClientCA != "" {
		pem, err := os.ReadFile(o.TLSClientCA)
		if err != nil {
			return fmt.Errorf("--tls-client-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--tls-client-ca %s: no PEM certificate in it: give the CA certificate(s) that sign the clients' certificates", o.TLSClientCA)
		}
		a.tlsConf.ClientCAs = pool
		a.tlsConf.ClientAuth = tls.RequireAndVerifyClientCert
		a.mTLS = true
	}
	return nil
}

// addHost adds an accepted Host: NAME (any port) or NAME:PORT.
func (a *Access) addHost(h string) error {
	h = strings.ToLower(strings.TrimSpace(h))
	if h == "" || strings.ContainsAny(h, "/ @?#") {
		return fmt.Errorf("--api-host %q: give a host name or address as clients write it in URLs, with or without :PORT (e.g. stasis-1.internal, 10.0.0.5:8443, [fd00::5])", h)
	}
	if name, port, err := net.SplitHostPort(h); err == nil {
		if a.hostPorts == nil {
			a.hostPorts = map[string]bool{}
		}
		a.hostPorts[net.JoinHostPort(strings.TrimSuffix(name, "."), port)] = true
		return nil
	}
	if a.names == nil {
		a.names = map[string]bool{}
	}
	a.names[strings.TrimSuffix(strings.Trim(h, "[]"), ".")] = true
	return nil
}

// defaultHosts accepts the names a non-loopback listener at ad answers
// to: its address, or for an unspecified one every interface address, the
// host name and the loopback names.
func (a *Access) defaultHosts(ad *net.TCPAddr) error {
	a.names = map[string]bool{}
	if !ad.IP.IsUnspecified() {
		a.names[ad.IP.String()] = true
		return nil
	}
	a.loopback = true
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return fmt.Errorf("the API's Host names: listing this machine's addresses: %w (give them with --api-host)", err)
	}
	for _, ia := range addrs {
		if n, ok := ia.(*net.IPNet); ok {
			a.names[n.IP.String()] = true
		}
	}
	if hn, err := os.Hostname(); err == nil && hn != "" {
		a.names[strings.ToLower(hn)] = true
	}
	return nil
}

// hostOK says whether a request's Host header is one this listener
// answers to.
func (a *Access) hostOK(host string) bool {
	if a.anyHost {
		return true
	}
	host = strings.ToLower(host)
	name, port, err := net.SplitHostPort(host)
	if err != nil {
		name, port = host, ""
	}
	name = strings.TrimSuffix(strings.Trim(name, "[]"), ".")
	if name == "" {
		return false
	}
	if a.loopback {
		if name == "localhost" {
			return true
		}
		if ip := net.ParseIP(name); ip != nil && ip.IsLoopback() {
			return true
		}
	}
	if a.names[name] {
		return true
	}
	return port != "" && a.hostPorts[net.JoinHostPort(name, port)]
}

// TLSConfig is the configuration to serve the API with over TLS, or nil
// for plain HTTP.
func (a *Access) TLSConfig() *tls.Config { return a.tlsConf }

// Listener returns ln, wrapped in TLS when the access says so.
func (a *Access) Listener(ln net.Listener) net.Listener {
	if a.tlsConf == nil {
		return ln
	}
	return tls.NewListener(ln, a.tlsConf)
}

// Authenticates says whether the API asks callers for credentials.
func (a *Access) Authenticates() bool { return len(a.tokens) > 0 || a.mTLS }

// tokenOK compares the presented token with every accepted one in
// constant time: digests of equal length, no early exit.
func (a *Access) tokenOK(tok string) bool {
	d := sha256.Sum256([]byte(tok))
	ok := 0
	for i := range a.tokens {
		ok |= subtle.ConstantTimeCompare(d[:], a.tokens[i][:])
	}
	return ok == 1
}

// Error types of the guard, with their status codes.
const (
	errUnauthorized = "unauthorized"           // 401
	errForbidden    = "forbidden"              // 403 (a cross-origin browser request)
	errMisdirected  = "misdirected"            // 421 (a Host this listener does not answer to)
	errMediaType    = "unsupported_media_type" // 415
)

// open is what answers without credentials: liveness, for probes that
// carry none (it tells only ok or unavailable).
func open(q *http.Request) bool {
	return q.URL.Path == "/healthz" && (q.Method == http.MethodGet || q.Method == http.MethodHead)
}

// Guard wraps h: the Host header (421), cross-origin browser requests
// (403), then credentials (401) for everything but /healthz. The
// Authorization header is read here only; nothing logs it.
func (a *Access) Guard(h http.Handler) http.Handler {
	cop := http.NewCrossOriginProtection()
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusForbidden, errForbidden, "a cross-origin request from a browser: the API takes requests from its clients, not from web pages")
	}))
	inner := cop.Handler(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		if !open(q) {
			if a.mTLS && (q.TLS == nil || len(q.TLS.VerifiedChains) == 0) {
				writeError(w, http.StatusUnauthorized, errUnauthorized, "this server needs a client certificate signed by its --tls-client-ca")
				return
			}
			if len(a.tokens) > 0 {
				scheme, tok, found := strings.Cut(q.Header.Get("Authorization"), " ")
				switch {
				case !found || !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(tok) == "":
					w.Header().Set("WWW-Authenticate", `Bearer realm="stasis"`)
					writeError(w, http.StatusUnauthorized, errUnauthorized, "this server needs a bearer token: send Authorization: Bearer TOKEN, TOKEN one of the lines of the server's --api-token-file")
					return
				case !a.tokenOK(strings.TrimSpace(tok)):
					w.Header().Set("WWW-Authenticate", `Bearer realm="stasis", error="invalid_token"`)
					writeError(w, http.StatusUnauthorized, errUnauthorized, "the bearer token is not one this server accepts (see its --api-token-file)")
					return
				}
			}
		}
		h.ServeHTTP(w, q)
	}))
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		if !a.hostOK(q.Host) {
			writeError(w, http.StatusMisdirectedRequest, errMisdirected, fmt.Sprintf("Host %q: this server does not answer to that name (a loopback server answers to localhost, 127.0.0.1 and [::1]; others to their --api-host names)", q.Host))
			return
		}
		inner.ServeHTTP(w, q)
	})
}

// jsonOnly refuses a request to h whose body is not declared JSON: a
// POST, PUT or PATCH needs Content-Type application/json even when empty
// (a cross-site form or text/plain POST cannot send that type without a
// CORS preflight, which the server does not grant); other methods may
// send no body, or a JSON one.
func jsonOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		ct := q.Header.Get("Content-Type")
		needs := q.Method == http.MethodPost || q.Method == http.MethodPut || q.Method == http.MethodPatch
		if needs || ct != "" || q.ContentLength > 0 || q.ContentLength < 0 && q.Body != nil && q.Body != http.NoBody {
			mt, _, err := mime.ParseMediaType(ct)
			if err != nil || mt != "application/json" {
				got := "no Content-Type"
				if ct != "" {
					got = fmt.Sprintf("Content-Type %q", ct)
				}
				writeError(w, http.StatusUnsupportedMediaType, errMediaType, fmt.Sprintf(
					"%s %s takes a JSON body (or none) sent as Content-Type: application/json; got %s (with curl: -H 'Content-Type: application/json')",
					q.Method, q.URL.Path, got))
				return
			}
		}
		h.ServeHTTP(w, q)
	})
}
