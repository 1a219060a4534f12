/**
 * `box.templates`: the built-in templates and the key's own (a sandbox's snapshot, or built
 * from a Dockerfile); `box.builds`: those builds (`/v1/templates/builds`, docs/templates.md).
 *
 * `builds.build(name, context)` packs the context (a directory, or files given in memory) as a
 * tar, starts the build, follows its NDJSON log (each event handed to `onEvent`) and returns
 * the finished {@link TemplateBuild}; a failed build throws {@link TemplateBuildError} carrying
 * it. `await box.templates()` is `box.templates.list()`.
 */

import * as calls from "./calls.js";
import { packContext, packFiles } from "./context.js";
import { StreamInterruptedError, TemplateBuildError, TemplateNotFoundError } from "./errors.js";
import { parseBuild, parseTemplate, type BuildEvent, type Template, type TemplateBuild } from "./models.js";
import type { Transport } from "./transport.js";

/** A build context: a local directory, or the files themselves (name -> text or bytes). */
export type BuildContext = string | Record<string, string | Uint8Array>;

export interface BuildOptions {
  /**
   * The Dockerfile: with a directory, a local path (default `CONTEXT/Dockerfile`; one outside
   * the context is added to the tar); with in-memory files, its name among them.
   */
  dockerfile?: string | undefined;
  /** Each event of the build's log as it arrives (may be async: it is awaited). */
  onEvent?: ((event: BuildEvent) => unknown) | undefined;
  /** false: return as soon as the build started (its `state` "queued" or "running"). */
  wait?: boolean | undefined;
  /** Stop following the log (the build itself goes on). */
  signal?: AbortSignal | undefined;
}

const FINISHED = new Set(["ready", "failed"]);

export class Builds {
  /** @internal */
  constructor(private readonly t: Transport) {}

  /** Build template `name` from `context` (default: the current directory) and, unless `wait:
   * false`, wait for it: the finished build, or {@link TemplateBuildError} if it failed. */
  async build(name: string, context: BuildContext = ".", options: BuildOptions = {}): Promise<TemplateBuild> {
    const started = await this.start(name, context, options.dockerfile);
    if (options.wait === false) return started;
    return this.wait(started.id, options);
  }

  /** Start a build and return at once (`POST /v1/templates/builds`). */
  async start(name: string, context: BuildContext = ".", dockerfile?: string): Promise<TemplateBuild> {
    const packed = typeof context === "string"
      ? await packContext(context, dockerfile)
      : { tar: packFiles(context), dockerfile: dockerfile ?? "Dockerfile" };
    const data = await this.t.json<{ build?: unknown }>(calls.startBuild(name, packed.dockerfile, packed.tar));
    return parseBuild(data?.build);
  }

  async get(buildId: string): Promise<TemplateBuild> {
    return parseBuild((await this.t.json<{ build?: unknown }>(calls.getBuild(buildId)))?.build);
  }

  /** The build's events so far, then new ones until it ends. Breaking out closes the stream. */
  async *logs(buildId: string, signal?: AbortSignal): AsyncGenerator<BuildEvent, void, undefined> {
    yield* this.t.events(calls.buildLog(buildId), signal) as AsyncGenerator<BuildEvent, void, undefined>;
  }

  /** Follow a build to its end (its log to `onEvent`): the finished build, or
   * {@link TemplateBuildError} if it failed. */
  async wait(buildId: string, options: Omit<BuildOptions, "dockerfile" | "wait"> = {}): Promise<TemplateBuild> {
    for await (const event of this.logs(buildId, options.signal)) await options.onEvent?.(event);
    const build = await this.get(buildId);
    if (!FINISHED.has(build.state)) {
      throw new StreamInterruptedError(`the log of build ${buildId} ended before its 'done' line (the build goes on)`);
    }
    if (build.state === "failed") throw new TemplateBuildError(build);
    return build;
  }
}

/** `box.templates`: call it (`await box.templates()`) for the list, as `list()`. */
export interface Templates {
  (): Promise<Template[]>;
  list(): Promise<Template[]>;
  get(name: string): Promise<Template>;
  /** Delete one of the key's templates; false if it did not exist. Sandboxes made from it keep
   * working (its files go when the last of them does); a built-in is a ConflictError. */
  delete(name: string): Promise<boolean>;
  /** {@link Builds.build}: a template from a Dockerfile. */
  build(name: string, context?: BuildContext, options?: BuildOptions): Promise<TemplateBuild>;
}

/** @internal */
export function templatesOf(t: Transport, builds: Builds): Templates {
  const list = async (): Promise<Template[]> => {
    const data = await t.json<{ templates?: unknown[] }>(calls.templates());
    return (data?.templates ?? []).map(parseTemplate);
  };
  return Object.assign(list, {
    list,
    get: async (name: string): Promise<Template> => parseTemplate(await t.json(calls.getTemplate(name))),
    delete: async (name: string): Promise<boolean> => {
      try {
        await t.discard(calls.deleteTemplate(name));
        return true;
      } catch (exc) {
        if (exc instanceof TemplateNotFoundError) return false;
        throw exc;
      }
    },
    build: (name: string, context?: BuildContext, options?: BuildOptions) => builds.build(name, context, options),
  });
}
