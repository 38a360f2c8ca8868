package blob

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"
)

// S3Options configures OpenS3. A zero field takes its value from the
// usual AWS environment variables, then from the default named.
type S3Options struct {
	// Endpoint is the S3 server's URL, http://HOST[:PORT] (no TLS) or
	// https://HOST[:PORT]; $AWS_ENDPOINT_URL_S3, then $AWS_ENDPOINT_URL;
	// default: AWS S3 itself. With an endpoint, buckets are addressed
	// path-style (ENDPOINT/BUCKET/OBJECT), which every S3 server serves.
	Endpoint string
	// AccessKeyID, SecretAccessKey and SessionToken are the credentials:
	// $AWS_ACCESS_KEY_ID, $AWS_SECRET_ACCESS_KEY, $AWS_SESSION_TOKEN.
	// Without a key and secret, requests go unsigned (anonymous).
	AccessKeyID, SecretAccessKey, SessionToken string
	// Region is the bucket's region: $AWS_REGION, then
	// $AWS_DEFAULT_REGION; default: us-east-1 with an Endpoint, else asked
	// of AWS.
	Region string

	// CacheDir holds this node's read cache (CacheDir/blobs, blobs read
	// from S3, verified when written and again when read) and the
	// temporary files of batches and pack files being written
	// (CacheDir/staging). One S3 value uses it at a time (it is locked).
	// Default: no read cache, temporary files in os.TempDir().
	CacheDir string
	// CacheBytes bounds the read cache: the least recently used blobs go
	// first, and the blobs in it never add up to more than CacheBytes.
	// Default 1 GiB when there is a CacheDir.
	CacheBytes int64

	// PartSize is the size of a multipart upload's parts: a pack larger
	// than it goes up in parts of this size, Concurrency at once. Default
	// 16 MiB (5 MiB at least, S3's minimum; a 256 MiB pack is 16 parts).
	PartSize int64
	// Concurrency is how many parts of one pack go up at once. Default 4.
	Concurrency int

	// ConnectTimeout bounds the opening check of the bucket and each
	// connection's dial, so that an unreachable endpoint is an error, not
	// a hang. Default 15s.
	ConnectTimeout time.Duration
	// MaxRetries is how many times one request is tried when the server
	// fails it (a 5xx, a throttle, a cut connection). Default 5.
	MaxRetries int
	// HasMaxAge is how old this node's view of the bucket's indexes may
	// be when Has does not find a key in it: an older view is listed
	// again first. Get always lists again before it reports a key
	// missing; Walk and deletes always list first. Default 2s; negative:
	// Has lists again at every miss.
	HasMaxAge time.Duration
	// ReuseWithin, if set, makes Has (and Put's check of what is already
	// stored) report a blob only when a copy of it was stored within this
	// window; an older blob reads as absent to Has (Get still serves it),
	// so a writer stores it anew instead of relying on a copy that a
	// collector elsewhere may be deleting. With it, a GC grace period
	// longer than ReuseWithin plus the longest snapshot can never collect
	// a blob a snapshot in progress on another node relies on. Default 0:
	// Has reports every stored blob, and a GC anywhere must not run while
	// a snapshot does (as with Dir).
	ReuseWithin time.Duration
}

// s3Config is S3Options with the environment and defaults applied.
type s3Config struct {
	loc                                    s3Location
	endpoint                               string // host[:port]
	secure                                 bool
	custom                                 bool // an endpoint was given: path-style
	accessKey, secretKey, sessionToken     string
	region                                 string
	cacheDir                               string
	cacheBytes, partSize                   int64
	concurrency, maxRetries                int
	connectTimeout, hasMaxAge, reuseWithin time.Duration
}

const (
	defaultCacheBytes     = 1 << 30
	defaultPartSize       = 16 << 20
	minPartSize           = 5 << 20
	defaultConcurrency    = 4
	defaultConnectTimeout = 15 * time.Second
	defaultMaxRetries     = 5
	defaultHasMaxAge      = 2 * time.Second
	awsEndpoint           = "s3.amazonaws.com"
)

// resolveS3 applies the environment (getenv) and the defaults to opts.
func resolveS3(rawURL string, opts S3Options, getenv func(string) string) (s3Config, error) {
	loc, err := parseS3URL(rawURL)
	if err != nil {
		return s3Config{}, err
	}
	first := func(v string, envs ...string) string {
		for _, e := range envs {
			if v != "" {
				break
			}
			v = getenv(e)
		}
		return v
	}
	c := s3Config{
		loc:            loc,
		accessKey:      first(opts.AccessKeyID, "AWS_ACCESS_KEY_ID"),
		secretKey:      first(opts.SecretAccessKey, "AWS_SECRET_ACCESS_KEY"),
		sessionToken:   first(opts.SessionToken, "AWS_SESSION_TOKEN"),
		region:         first(opts.Region, "AWS_REGION", "AWS_DEFAULT_REGION"),
		cacheDir:       opts.CacheDir,
		cacheBytes:     opts.CacheBytes,
		partSize:       opts.PartSize,
		concurrency:    opts.Concurrency,
		maxRetries:     opts.MaxRetries,
		connectTimeout: opts.ConnectTimeout,
		hasMaxAge:      opts.HasMaxAge,
		reuseWithin:    opts.ReuseWithin,
	}
	if (c.accessKey == "") != (c.secretKey == "") {
		return s3Config{}, fmt.Errorf("s3 store %s: an access key without its secret, or a secret without its key: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or S3Options.AccessKeyID and SecretAccessKey), or neither for anonymous access", loc)
	}
	ep := first(opts.Endpoint, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
	if ep == "" {
		c.endpoint, c.secure = awsEndpoint, true
	} else {
		c.custom = true
		if c.endpoint, c.secure, err = parseEndpoint(ep); err != nil {
			return s3Config{}, fmt.Errorf("s3 store %s: %w", loc, err)
		}
		if c.region == "" {
			c.region = "us-east-1"
		}
	}
	switch {
	case c.cacheBytes < 0:
		return s3Config{}, fmt.Errorf("s3 store %s: CacheBytes %d is negative: give the read cache's bound in bytes (0: 1 GiB)", loc, c.cacheBytes)
	case c.cacheBytes == 0:
		c.cacheBytes = defaultCacheBytes
	}
	switch {
	case c.partSize == 0:
		c.partSize = defaultPartSize
	case c.partSize < minPartSize || c.partSize > 5<<30:
		return s3Config{}, fmt.Errorf("s3 store %s: PartSize %d is out of S3's range: give 5 MiB to 5 GiB (0: 16 MiB)", loc, c.partSize)
	}
	if c.concurrency <= 0 {
		c.concurrency = defaultConcurrency
	}
	if c.maxRetries <= 0 {
		c.maxRetries = defaultMaxRetries
	}
	if c.connectTimeout <= 0 {
		c.connectTimeout = defaultConnectTimeout
	}
	if c.hasMaxAge == 0 {
		c.hasMaxAge = defaultHasMaxAge
	}
	return c, nil
}

// parseEndpoint parses an endpoint URL: http or https, a host and perhaps
// a port, nothing else.
func parseEndpoint(raw string) (hostPort string, secure bool, err error) {
	bad := func(why string) error {
		return fmt.Errorf("S3 endpoint %q: %s; give http://HOST[:PORT] (no TLS) or https://HOST[:PORT] in AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or S3Options.Endpoint", raw, why)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", false, bad(err.Error())
	}
	switch u.Scheme {
	case "http":
	case "https":
		secure = true
	case "":
		return "", false, bad("no scheme")
	default:
		return "", false, bad("scheme " + u.Scheme + " is neither http nor https")
	}
	if u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return "", false, bad("only a scheme, a host and a port may be given")
	}
	if u.Port() != "" {
		if _, _, err := net.SplitHostPort(u.Host); err != nil {
			return "", false, bad(err.Error())
		}
	}
	return u.Host, secure, nil
}

// s3Location is where a store lives: a bucket and a prefix under which
// its objects are, "" or ending in "/".
type s3Location struct {
	bucket, prefix string
}

// String is the location's canonical URL.
func (l s3Location) String() string {
	return "s3://" + l.bucket + "/" + strings.TrimSuffix(l.prefix, "/")
}

// object is the URL of one of the store's objects, for messages.
func (l s3Location) object(name string) string {
	return "s3://" + l.bucket + "/" + l.prefix + name
}

// maxPrefix bounds a prefix, leaving room in S3's 1024-byte object names.
const maxPrefix = 512

// parseS3URL parses s3://BUCKET[/PREFIX]. It is strict: the bucket must
// follow S3's naming rules, and the prefix is slash-separated segments of
// letters, digits, '.', '_' and '-', none of them empty, "." or "..", so
// that no object name the store makes can be read as a path elsewhere.
func parseS3URL(raw string) (s3Location, error) {
	bad := func(why string) (s3Location, error) {
		show := raw
		if len(show) > 200 {
			show = show[:200] + "..."
		}
		return s3Location{}, fmt.Errorf("s3 URL %q: %s; want s3://BUCKET or s3://BUCKET/PREFIX, e.g. s3://my-bucket/stasis", show, why)
	}
	rest, ok := strings.CutPrefix(raw, "s3://")
	if !ok {
		return bad("it does not begin with s3://")
	}
	if strings.ContainsAny(rest, "?#%@\\") {
		return bad("queries, fragments, escapes, user names and backslashes are not allowed")
	}
	bucket, path, _ := strings.Cut(rest, "/")
	if err := checkBucketName(bucket); err != nil {
		return bad(err.Error())
	}
	path = strings.TrimSuffix(path, "/")
	if path == "" {
		return s3Location{bucket: bucket}, nil
	}
	if len(path) > maxPrefix {
		return bad(fmt.Sprintf("the prefix is over %d bytes", maxPrefix))
	}
	for _, seg := range strings.Split(path, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return bad("the prefix has an empty, \".\" or \"..\" segment")
		}
		for i := 0; i < len(seg); i++ {
			if c := seg[i]; !isAlnum(c) && c != '.' && c != '_' && c != '-' {
				return bad(fmt.Sprintf("the prefix has %q: use letters, digits, '.', '_', '-' and '/'", c))
			}
		}
	}
	return s3Location{bucket: bucket, prefix: path + "/"}, nil
}

// checkBucketName applies S3's rules for bucket names: 3 to 63 lowercase
// letters, digits, dots and hyphens, beginning and ending with a letter or
// digit, no two dots together, not an IP address.
func checkBucketName(b string) error {
	if len(b) < 3 || len(b) > 63 {
		return errors.New("a bucket name is 3 to 63 characters")
	}
	for i := 0; i < len(b); i++ {
		c := b[i]
		if !isLowerAlnum(c) && c != '.' && c != '-' {
			return fmt.Errorf("a bucket name is lowercase letters, digits, '.' and '-', not %q", c)
		}
	}
	if !isLowerAlnum(b[0]) || !isLowerAlnum(b[len(b)-1]) {
		return errors.New("a bucket name begins and ends with a letter or a digit")
	}
	if strings.Contains(b, "..") {
		return errors.New("a bucket name has no two dots together")
	}
	if net.ParseIP(b) != nil {
		return errors.New("a bucket name is not an IP address")
	}
	return nil
}

func isLowerAlnum(c byte) bool { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') }
func isAlnum(c byte) bool      { return isLowerAlnum(c) || (c >= 'A' && c <= 'Z') }
