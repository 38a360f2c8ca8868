package cas

import (
	"context"
	"sync"
)

// fanOut runs produce, which sends jobs, while workers run a work function
// each (from newWorker, so a worker may keep its own buffers) on the jobs.
// The first error, from produce or from a job, cancels the rest and is
// returned; so is the context's error if it ends first.
func fanOut[J any](ctx context.Context, workers int, produce func(context.Context, chan J) error, newWorker func() func(context.Context, J) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	jobs := make(chan J)
	var (
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	fail := func(err error) {
		errOnce.Do(func() { firstErr = err; cancel() })
	}
	for i := 0; i < workers; i++ {
		wg.Add(1)
		work := newWorker()
		go func() {
			defer wg.Done()
			for j := range jobs {
				if ctx.Err() != nil {
					continue // drain: the whole has failed
				}
				if err := work(ctx, j); err != nil {
					fail(err)
				}
			}
		}()
	}
	err := produce(ctx, jobs)
	close(jobs)
	wg.Wait()
	if err != nil {
		fail(err)
	}
	if firstErr == nil && ctx.Err() != nil {
		firstErr = ctx.Err()
	}
	return firstErr
}
