package blob

import (
	"net/http"
	"sync"
	"time"
)

// serverClock estimates the S3 server's clock from the Date headers of
// its responses: the offset kept is the largest of Date minus the local
// time the response came (each a lower bound of the true offset, Date
// being truncated to the second) seen within a minute, so that the
// estimate is never later than the server's time, and follows its clock
// when it is set back.
type serverClock struct {
	mu    sync.Mutex
	skew  time.Duration
	taken time.Time // when skew was last taken
	have  bool
}

func (c *serverClock) sample(date, recv time.Time) {
	s := date.Sub(recv)
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.have || s >= c.skew || recv.Sub(c.taken) > time.Minute {
		c.skew, c.taken, c.have = s, recv, true
	}
}

// at is local time t by the server's clock.
func (c *serverClock) at(t time.Time) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return t.Add(c.skew)
}

// clockTransport feeds a serverClock with every response's Date.
type clockTransport struct {
	base  http.RoundTripper
	clock *serverClock
}

func (t *clockTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.base.RoundTrip(r)
	if err == nil {
		if d, perr := http.ParseTime(resp.Header.Get("Date")); perr == nil {
			t.clock.sample(d, time.Now())
		}
	}
	return resp, err
}
